//! RSI snapshot-isolation transactions over one-sided verbs, and the embedded client API.
//!
//! Empty until the txn issue fills it; see DESIGN.md ("Data layout", "RSI").
