//! Crash points: the process dies (`abort`) in the middle of a commit step, so the
//! chaos harness can show that every step is recoverable.
//!
//! Armed from a spec (`NAMDB_CRASH=after-lock:0.01,mid-install:0.002`, or `all:P`),
//! each point fires with its probability every time a commit passes it. Unarmed, a
//! point costs one relaxed load; our own few lines rather than the `fail` crate, whose
//! evaluation takes a lock on every pass and this sits on every commit.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

/// The commit steps, in order; names as in a spec.
pub const POINTS: &[&str] = &[
    "after-insert-blocks",
    "after-index",
    "after-lock",
    "after-log",
    "mid-install",
    "after-install",
    "install-posting",
];

/// A commit step at which a crash can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// New blocks are written, locked, but not yet in the index.
    AfterInsertBlocks = 0,
    /// New blocks are in the index, updated records not yet locked.
    AfterIndex = 1,
    /// Every record is locked and validated; no log record yet.
    AfterLock = 2,
    /// The log record is complete (the transaction is committed); nothing installed.
    AfterLog = 3,
    /// Some installs are posted, not all.
    MidInstall = 4,
    /// Everything is installed and unlocked; the timestamp is not decided yet.
    AfterInstall = 5,
    /// The install's lease check passed and nothing of it is posted yet: a stall here
    /// is a thread descheduled between the two ([`crate::Worker`]'s lease guard).
    InstallPosting = 6,
}

/// What passing a point may do: [`CRASH`] and [`STALL`] bits. One load on every pass.
static ARMED: AtomicU8 = AtomicU8::new(0);
/// Crash points are armed (by a spec, or per thread for tests).
const CRASH: u8 = 1;
/// A thread stalls at a point ([`stall_at_on_this_thread`], tests).
const STALL: u8 = 2;
/// A thread's lease checks or posts of decisions fail
/// ([`fail_lease_checks_on_this_thread`], [`fail_next_decisions_on_this_thread`], tests).
const FAIL_LEASE: u8 = 4;
/// Per point: the probability scaled to `u64::MAX` (0 = never).
static THRESHOLDS: [AtomicU64; POINTS.len()] = [const { AtomicU64::new(0) }; POINTS.len()];
static RNG: AtomicU64 = AtomicU64::new(0x853c_49e6_748f_ea9b);
/// For in-process tests: points are armed per thread ([`panic_at_on_this_thread`]),
/// and none aborts the process. Set once for good: tests running in parallel in one
/// process each arm their own thread, and one firing must not disarm another.
static PANIC_MODE: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The point whose next pass panics on this thread (tests).
    static PANIC_AT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// The point whose next pass on this thread runs the stall, with the commit's CID
    /// (tests).
    static STALL_AT: std::cell::RefCell<Option<(usize, Stall)>> =
        const { std::cell::RefCell::new(None) };
    /// Lease checks of this thread's commit steps still to pass, then to fail, and
    /// the CID of the last commit whose check failed (tests).
    static FAILING_LEASE_CHECKS: std::cell::Cell<(u32, u32, Option<u64>)> =
        const { std::cell::Cell::new((0, 0, None)) };
    /// Whether this thread's next post of decisions fails (tests).
    static FAILING_DECISIONS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// For tests: of the calling thread's lease checks before its commit steps, the next
/// `pass` pass and the `fail` after them fail as if the oracle's memory server did
/// not answer (a transport error, not a fence: the worker cannot tell whether it
/// still holds its slot). [`failed_lease_check_cid`] names the commit.
pub fn fail_lease_checks_on_this_thread(pass: u32, fail: u32) {
    FAILING_LEASE_CHECKS.with(|c| c.set((pass, fail, None)));
    ARMED.fetch_or(FAIL_LEASE, Ordering::Relaxed);
}

/// For tests: the calling thread's next post of its queued timestamp decisions fails
/// as if the oracle's memory server did not answer (after which the worker cannot
/// tell which of them landed).
pub fn fail_next_decisions_on_this_thread() {
    FAILING_DECISIONS.with(|c| c.set(true));
    ARMED.fetch_or(FAIL_LEASE, Ordering::Relaxed);
}

/// Whether this post of decisions fails ([`fail_next_decisions_on_this_thread`]).
#[inline]
pub(crate) fn decisions_fail() -> bool {
    ARMED.load(Ordering::Relaxed) & FAIL_LEASE != 0 && FAILING_DECISIONS.with(|c| c.replace(false))
}

/// What a failing lease check or post of decisions returns: a transport error, as
/// from an oracle server that did not answer.
pub(crate) fn injected_transport_error() -> timestamp::OracleError {
    timestamp::OracleError::Fabric(fabric::FabricError::Completion {
        status: fabric::WcStatus::RetryExceeded,
        index: 0,
    })
}

/// The CID of the calling thread's last commit whose lease check failed by
/// [`fail_lease_checks_on_this_thread`].
pub fn failed_lease_check_cid() -> Option<u64> {
    FAILING_LEASE_CHECKS.with(|c| c.get().2)
}

/// Whether this lease check, of commit `cid`, fails
/// ([`fail_lease_checks_on_this_thread`]).
#[inline]
pub(crate) fn lease_check_fails(cid: u64) -> bool {
    ARMED.load(Ordering::Relaxed) & FAIL_LEASE != 0
        && FAILING_LEASE_CHECKS.with(|c| match c.get() {
            (0, 0, _) => false,
            (0, fail, _) => {
                c.set((0, fail - 1, Some(cid)));
                true
            }
            (pass, fail, last) => {
                c.set((pass - 1, fail, last));
                false
            }
        })
}

/// What a thread does when it stalls at a point: it blocks in here, given the CID of
/// the commit it stalls.
pub type Stall = Box<dyn FnOnce(u64)>;

/// Arms the points of `spec` (`POINT:PROBABILITY,…`, POINT a name of [`POINTS`] or
/// `all`, PROBABILITY in 0..=1). An empty spec arms nothing.
pub fn arm(spec: &str) -> Result<(), String> {
    let mut thresholds = [0u64; POINTS.len()];
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, p) = part
            .split_once(':')
            .ok_or_else(|| format!("crash point `{part}`: expected POINT:PROBABILITY"))?;
        let p: f64 = p
            .trim()
            .parse()
            .map_err(|_| format!("crash point `{part}`: `{p}` is not a probability"))?;
        if !(0.0..=1.0).contains(&p) {
            return Err(format!(
                "crash point `{part}`: the probability must be in 0..=1"
            ));
        }
        let threshold = (p * u64::MAX as f64) as u64;
        match name.trim() {
            "all" => thresholds = [threshold; POINTS.len()],
            n => {
                let i = POINTS.iter().position(|&x| x == n).ok_or_else(|| {
                    format!(
                        "unknown crash point `{n}`; the points are {} and all",
                        POINTS.join(", ")
                    )
                })?;
                thresholds[i] = threshold;
            }
        }
    }
    for (cell, t) in THRESHOLDS.iter().zip(thresholds) {
        cell.store(t, Ordering::Relaxed);
    }
    let seed = std::process::id() as u64
        ^ std::time::UNIX_EPOCH
            .elapsed()
            .map_or(0, |d| d.as_nanos() as u64);
    RNG.store(seed | 1, Ordering::Relaxed);
    if thresholds.iter().any(|&t| t > 0) {
        ARMED.fetch_or(CRASH, Ordering::Relaxed);
    } else {
        ARMED.fetch_and(!CRASH, Ordering::Relaxed);
    }
    Ok(())
}

/// Arms the points of the environment variable `NAMDB_CRASH`, if set.
pub fn arm_from_env() -> Result<(), String> {
    match std::env::var("NAMDB_CRASH") {
        Ok(spec) => arm(&spec).map_err(|e| format!("NAMDB_CRASH: {e}")),
        Err(std::env::VarError::NotPresent) => Ok(()),
        Err(e) => Err(format!("NAMDB_CRASH: {e}")),
    }
}

/// Whether any point is armed (commits then split their installs in two, so a crash
/// can land between the halves).
#[inline]
pub(crate) fn armed() -> bool {
    ARMED.load(Ordering::Relaxed) & CRASH != 0
}

/// Dies here if `point` is armed and its draw says so; stalls here if this thread
/// was told to (commit `cid` is passing).
#[inline]
pub(crate) fn point(point: CrashPoint, cid: u64) {
    if ARMED.load(Ordering::Relaxed) != 0 {
        maybe_die(point, cid);
    }
}

/// For in-process tests of recovery: the calling thread's next commit to pass `name`
/// panics there (once), as if its node died at that step; other threads are not
/// affected. Catch the panic and leak the worker, as a dead process would.
pub fn panic_at_on_this_thread(name: &str) -> Result<(), String> {
    let i = POINTS
        .iter()
        .position(|&x| x == name)
        .ok_or_else(|| format!("unknown crash point `{name}`"))?;
    PANIC_AT.with(|p| p.set(Some(i)));
    PANIC_MODE.store(true, Ordering::Relaxed);
    ARMED.fetch_or(CRASH, Ordering::Relaxed);
    Ok(())
}

/// For in-process tests of what a starved thread does to its commits: the calling
/// thread's next commit to pass `name` runs `stall` there (once), with the commit's
/// CID, and goes on when it returns. A stall that outlasts the worker's lease, as a
/// thread descheduled on a loaded machine does, gets the slot fenced under the commit
/// ([`crate::TxnError::Fenced`]). Unlike the crash points, commits keep their batched
/// steps; nothing else changes for other threads.
pub fn stall_at_on_this_thread(name: &str, stall: Stall) -> Result<(), String> {
    let i = POINTS
        .iter()
        .position(|&x| x == name)
        .ok_or_else(|| format!("unknown crash point `{name}`"))?;
    STALL_AT.with(|s| *s.borrow_mut() = Some((i, stall)));
    ARMED.fetch_or(STALL, Ordering::Relaxed);
    Ok(())
}

/// For tests: the calling thread's next commit to pass `name` stalls there until `db`
/// has fenced its slot and recovered what it held ([`crate::Database::wait_for_recovery_of`]),
/// as a thread descheduled past its lease is; it panics if that takes longer than
/// `patience`.
pub fn starve_at_on_this_thread(
    db: &crate::Database,
    name: &'static str,
    patience: std::time::Duration,
) -> Result<(), String> {
    let db = db.clone();
    stall_at_on_this_thread(
        name,
        Box::new(move |cid| {
            assert!(
                db.wait_for_recovery_of(cid, patience),
                "stalled at {name}: the slot of commit {cid} was not fenced and recovered \
                 within {patience:?}"
            );
        }),
    )
}

/// For tests of what a commit's outcome is while its recovery has not finished: as
/// [`starve_at_on_this_thread`], but the recovery of the stalled commit's slot stalls
/// too, once it began (the fencer claimed the holder's work, so every other node waits
/// for it, as for a recovering node starved of CPU, and takes it over only after
/// [`crate::recovery::TAKEOVER`]). The commit's stall ends once the recovery is held
/// (it panics if that takes longer than `patience`), so the commit ends fenced
/// ([`crate::TxnError::Fenced`]) with its outcome undecided; the recovery goes on once
/// the returned hold is released or dropped.
pub fn starve_at_with_recovery_held_on_this_thread(
    db: &crate::Database,
    name: &'static str,
    patience: std::time::Duration,
) -> Result<crate::recovery::RecoveryHold, String> {
    starve_with_recovery_held(db, name, patience, false)
}

/// As [`starve_at_with_recovery_held_on_this_thread`], but once released the recovery
/// goes on without another look at its guard first: a recovering node descheduled
/// after its last look and before its scan, for longer than
/// [`crate::recovery::TAKEOVER`], so that the recovery may have been taken over,
/// finished and the slot adopted by a new holder meanwhile.
/// [`crate::recovery::RecoveryHold::release_and_wait`] tells when it returned.
pub fn starve_at_with_recovery_held_past_its_check_on_this_thread(
    db: &crate::Database,
    name: &'static str,
    patience: std::time::Duration,
) -> Result<crate::recovery::RecoveryHold, String> {
    starve_with_recovery_held(db, name, patience, true)
}

fn starve_with_recovery_held(
    db: &crate::Database,
    name: &'static str,
    patience: std::time::Duration,
    past_check: bool,
) -> Result<crate::recovery::RecoveryHold, String> {
    let hold = crate::recovery::RecoveryHold {
        state: std::sync::Arc::new(crate::recovery::HoldState::new(past_check)),
    };
    let (db, state) = (db.clone(), hold.state.clone());
    stall_at_on_this_thread(
        name,
        Box::new(move |cid| {
            state.set_cid(cid);
            let slot = (cid % u64::from(db.options().slots)) as u32;
            // Armed here, at the start of the stall: the lease lapses only later, so
            // the slot's recovery has not begun.
            *crate::store::lock(&db.shared.recovery_hold) = Some((slot, state.clone()));
            assert!(
                state.wait_until_held(patience),
                "stalled at {name}: the recovery of the slot of commit {cid} did not begin \
                 within {patience:?}"
            );
        }),
    )?;
    Ok(hold)
}

/// For tests of a claimer stopped between its claim of an oracle slot and its
/// adoption of the slot's commit log: the next worker of `db` to adopt a slot (a new
/// client's, or a rejoin) stalls before its first look at the slot's guard until the
/// returned hold is released or dropped ([`crate::recovery::RecoveryHold::is_holding`]
/// says when it stalls, [`crate::recovery::RecoveryHold::release_and_wait`] when the
/// adoption returned).
pub fn hold_next_slot_adoption(db: &crate::Database) -> crate::recovery::RecoveryHold {
    let state = std::sync::Arc::new(crate::recovery::HoldState::new(false));
    *crate::store::lock(&db.shared.adoption_hold) = Some(state.clone());
    crate::recovery::RecoveryHold { state }
}

#[cold]
fn maybe_die(point: CrashPoint, cid: u64) {
    let stall = STALL_AT.with(|s| {
        let mut s = s.borrow_mut();
        match s.take() {
            Some((at, stall)) if at == point as usize => Some(stall),
            other => {
                *s = other;
                None
            }
        }
    });
    if let Some(stall) = stall {
        stall(cid);
    }
    if !armed() {
        return;
    }
    if PANIC_MODE.load(Ordering::Relaxed) {
        if PANIC_AT.with(|p| p.get()) == Some(point as usize) {
            PANIC_AT.with(|p| p.set(None));
            panic!("crash point {} (test)", POINTS[point as usize]);
        }
        return;
    }
    let threshold = THRESHOLDS[point as usize].load(Ordering::Relaxed);
    // xorshift; races between threads only make the draws less independent.
    let mut x = RNG.load(Ordering::Relaxed);
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    RNG.store(x, Ordering::Relaxed);
    if x < threshold {
        eprintln!(
            "namdb: crash point {} fired (NAMDB_CRASH); aborting the process",
            POINTS[point as usize]
        );
        std::process::abort();
    }
}

/// For tests of fenced commits: a thread with a client of its own that commits `body`
/// (retried up to 10 times) and ticks its oracle slot, every 2 ms, until stopped. Its
/// commits need read timestamps while a stalled slot holds the prefix back, and its
/// ticks fence that slot and recover what it held: what
/// [`starve_at_on_this_thread`] and its kin wait for.
pub struct Fencer {
    stop: std::sync::Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<crate::Result<()>>>,
}

impl Fencer {
    /// Starts the thread and returns once its client holds a slot.
    pub fn spawn(
        db: &crate::Database,
        mut body: impl FnMut(&mut crate::Transaction<'_>) -> crate::Result<()> + Send + 'static,
    ) -> crate::Result<Fencer> {
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let thread = {
            let (db, stop) = (db.clone(), stop.clone());
            std::thread::Builder::new()
                .name("fencer".into())
                .spawn(move || {
                    let mut client = match db.client() {
                        Ok(client) => client,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return Err(e);
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    // Goes on after a failure (its own slot fenced while the machine
                    // is starved, say), which the stop reports.
                    let mut first_failure = Ok(());
                    while !stop.load(Ordering::Relaxed) {
                        let done = client.run(10, &mut body).and_then(|_| client.tick());
                        if first_failure.is_ok() {
                            first_failure = done;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(2));
                    }
                    first_failure
                })
                .map_err(|e| crate::TxnError::Invalid(format!("cannot start a fencer: {e}")))?
        };
        let fencer = Fencer {
            stop,
            thread: Some(thread),
        };
        match ready.recv() {
            Ok(Ok(())) => Ok(fencer),
            Ok(Err(_)) | Err(_) => Err(fencer.stop().err().unwrap_or_else(|| {
                crate::TxnError::Invalid("the fencer ended before it had a client".into())
            })),
        }
    }

    /// Stops the thread and answers its first failed commit or tick, if any.
    pub fn stop(mut self) -> crate::Result<()> {
        self.stop_thread()
    }

    fn stop_thread(&mut self) -> crate::Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(ended)) => ended,
            Some(Err(_)) => Err(crate::TxnError::Invalid("the fencer panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for Fencer {
    fn drop(&mut self) {
        let _ = self.stop_thread();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_are_clear_errors() {
        assert!(arm("").is_ok());
        assert!(!armed());
        assert!(arm("after-lock:0, mid-install:0").is_ok());
        assert!(!armed());
        let e = arm("after-lok:0.5").unwrap_err();
        assert!(e.contains("unknown crash point `after-lok`"), "{e}");
        assert!(arm("after-lock").unwrap_err().contains("POINT:PROBABILITY"));
        assert!(arm("after-lock:2").unwrap_err().contains("0..=1"));
        assert!(arm("all:x").unwrap_err().contains("not a probability"));
        // Never armed with a positive probability here: a test process must not die.
        assert!(!armed());
    }
}
