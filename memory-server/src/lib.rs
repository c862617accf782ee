//! The namdb memory-server process: region allocation and registration, control plane, housekeeping.
//!
//! Empty until the memory-server issue fills it; see DESIGN.md ("Memory server").
