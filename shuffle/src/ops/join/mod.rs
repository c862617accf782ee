//! Distributed joins over the shuffle.
