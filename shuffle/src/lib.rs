//! RDMA-aware data shuffling endpoints, flows and analytical operators.
//!
//! Empty until the shuffle issue fills it; see DESIGN.md ("Shuffle").
