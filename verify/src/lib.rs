//! History recording and snapshot-isolation checkers.
//!
//! Empty until the verify issue fills it; see DESIGN.md ("Verification").
