//! The bit-vector timestamp oracle: region layout and client-side protocol.
//!
//! Empty until the timestamp-oracle issue fills it; see DESIGN.md ("Timestamp oracle").
