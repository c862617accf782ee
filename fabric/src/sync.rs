//! Synchronisation primitives, switched to loom's under `cfg(fabric_loom)` so the sim
//! backend and the protocols above it can be model-checked.
//!
//! `Arc` stays std's in both builds: loom's cannot hold trait objects, and reference
//! counts are not what the models check.

#[cfg(fabric_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};
#[cfg(fabric_loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard, RwLock};

#[cfg(not(fabric_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};
#[cfg(not(fabric_loom))]
pub(crate) use std::sync::{Mutex, MutexGuard, RwLock};

pub use std::sync::atomic::Ordering;

/// Locks a mutex, ignoring poisoning: every critical section in fabric leaves its data
/// consistent before anything that can panic, so a poisoned lock holds valid state.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn read<T>(m: &RwLock<T>) -> impl std::ops::Deref<Target = T> + '_ {
    m.read().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn write<T>(m: &RwLock<T>) -> impl std::ops::DerefMut<Target = T> + '_ {
    m.write().unwrap_or_else(|e| e.into_inner())
}
