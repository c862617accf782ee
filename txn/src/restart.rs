//! Restart recovery: what a cluster of durable memory servers ([`crate::durable`])
//! repairs after one of them restarted, before anyone uses the database again.
//!
//! A restarted server comes back with what was persisted: every acknowledged commit's
//! installs, records and index entries, but possibly not those of commits in flight
//! when it died, and (server 0) an oracle and log guards as old as the catalog. Every
//! commit record stays in its ring until the commit's installs are durable, so the
//! records in the rings cover everything a restart may have lost:
//!
//! 1. Every record's entries on a restarted server are rolled forward, in CID order,
//!    unless the block already holds that CID or a later one: an update or delete is
//!    installed over the kept block, an insert's block is written again from the
//!    logged value, its index entry and arena counter are restored.
//! 2. If server 0 restarted, the oracle was lost, so no commit that was in flight can
//!    finish: every lock on every server is resolved from the records (rolled forward
//!    if a record commits it, released otherwise), and the oracle starts afresh above
//!    every CID the data and the log hold ([`timestamp::Layout::image_from`]), all
//!    slots free and all log guards clean.
//!
//! Which servers restarted: each durable server counts its starts (its *boot*), and
//! server 0's catalog region records the boot of each server the cluster last ran
//! with:
//!
//! ```text
//! 8192        guard: 0 idle, else runner nonce << 32 | server 0's boot (low 32 bits):
//!             a guard of an earlier boot is stale (a persist of the catalog caught
//!             it), and is freed at once
//! 8200 + 8·s  boot of server s the cluster runs at (0: not recorded yet)
//! ```
//!
//! A node that opens the database compares them with the servers' boots; on a
//! difference, one node (CAS on the guard) repairs and records the new boots while
//! the others wait; a runner silent for [`TAKEOVER`] is taken over. Nodes that were
//! running when a server restarted lost their connections to it (and, for server 0,
//! the oracle): they reopen the database, which waits for the repair.

use crate::commitlog::{self, EntryKind, Guard, LogRecord};
use crate::conn::Conn;
use crate::durable::PersistPlan;
use crate::error::{Result, TxnError};
use crate::index::{RemoteIndex, Slot};
use crate::layout::{self, Block, Header, VERSIONS_OFFSET};
use crate::recovery::{
    PendingClaim, Written, add_written, nonce, resolve, scan_headers, settle_pending,
    unpublished_keys,
};
use crate::store::{Database, Table};
use crate::transaction::{add_block, add_insert};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a restart recovery may hold the guard unchanged before another node takes
/// it over.
pub const TAKEOVER: Duration = Duration::from_secs(30);
const AREA: u64 = 8192;
const MAX_SERVERS: usize = ((32 << 10) - AREA as usize) / 8 - 1;

/// What one restart recovery did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartReport {
    /// The servers whose restart it repaired.
    pub restarted: Vec<usize>,
    /// Complete records found in the log rings.
    pub log_records: u64,
    /// Blocks written again from a record (a restarted server had lost the install).
    pub reinstalled: u64,
    /// Locks of committed transactions, rolled forward.
    pub locks_rolled_forward: u64,
    /// Locks of transactions that had not committed, released.
    pub locks_rolled_back: u64,
    /// Index slots a restarted server kept claimed without an address, whose
    /// claimer's block it lost, given a tombstone block.
    pub claims_settled: u64,
    pub blocks_scanned: u64,
    /// Where the new oracle starts, if server 0 restarted.
    pub oracle_from: Option<u64>,
    pub took: Duration,
}

/// Runs or waits for the restart recovery the servers' `boots` call for; returns the
/// report if this node ran it.
pub(crate) fn after_open(db: &Database, boots: &[u64]) -> Result<Option<RestartReport>> {
    if boots.len() > MAX_SERVERS {
        return Err(TxnError::Invalid(format!(
            "a durable cluster has at most {MAX_SERVERS} memory servers"
        )));
    }
    let area = db.shared.catalog.servers()[0].catalog.at(AREA);
    let words = 1 + boots.len() as u64;
    let mut watching: Option<(u64, Instant)> = None;
    loop {
        let bytes = db.recovery_conns()[0].read_bytes(area, words * 8)?;
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8"));
        let guard = word(0);
        let recorded: Vec<u64> = (0..boots.len()).map(|s| word(1 + s)).collect();
        let restarted: Vec<usize> = (0..boots.len())
            .filter(|&s| recorded[s] != 0 && recorded[s] != boots[s])
            .collect();
        let fresh = recorded.contains(&0);
        if restarted.is_empty() && !fresh {
            // Whoever commits must have found the boots durable, or a later restart
            // could not tell what it has to repair.
            persist_boots(db, area, boots.len())?;
            return Ok(None);
        }
        if guard != 0 && guard & u32::MAX as u64 != boots[0] & u32::MAX as u64 {
            db.recovery_conns()[0].cas(area, guard, 0)?;
            continue;
        }
        if guard == 0 {
            let mine = (nonce() as u64) << 32 | (boots[0] & u32::MAX as u64);
            if db.recovery_conns()[0].cas(area, 0, mine)? != 0 {
                continue;
            }
            let report = if restarted.is_empty() {
                None
            } else {
                Some(repair(db, &restarted)?)
            };
            // The catalog as it is (a bootstrap may have just written it), then the
            // boots, then the guard free: the boots say the repair is done.
            db.persist_catalog()?;
            let mut now = Vec::with_capacity(boots.len() * 8);
            for &b in boots {
                now.extend_from_slice(&b.to_le_bytes());
            }
            db.recovery_conns()[0].write_bytes(area.offset_by(8), &now)?;
            persist_boots(db, area, boots.len())?;
            db.recovery_conns()[0].cas(area, mine, 0)?;
            return Ok(report);
        }
        match watching {
            Some((w, since)) if w == guard && since.elapsed() >= TAKEOVER => {
                // The runner stalled: free the guard for whoever gets it next.
                db.recovery_conns()[0].cas(area, guard, 0)?;
                watching = None;
            }
            Some((w, _)) if w == guard => std::thread::sleep(Duration::from_millis(5)),
            _ => watching = Some((guard, Instant::now())),
        }
    }
}

fn persist_boots(db: &Database, area: fabric::RemoteAddr, servers: usize) -> Result<()> {
    let mut plan = PersistPlan::default();
    plan.add(
        0,
        crate::durable::PersistRange::plain(area.offset_by(8), servers as u64 * 8),
    );
    db.shared.durability.persist_blocking(plan)
}

/// The repair itself (see the module doc).
fn repair(db: &Database, restarted: &[usize]) -> Result<RestartReport> {
    let started = Instant::now();
    let tables: HashMap<u32, Arc<Table>> = db.tables()?.into_iter().map(|t| (t.id, t)).collect();
    let log = db.shared.catalog.commit_log();
    let oracle = db.shared.catalog.oracle();
    let server0 = restarted.contains(&0);
    let mut conns = db.recovery_conns();
    let mut records: Vec<LogRecord> = Vec::new();
    for slot in 0..log.slots {
        records.extend(crate::recovery::read_ring(db, &mut conns, slot)?.into_values());
    }
    records.sort_by_key(|r| r.cid);
    let mut report = RestartReport {
        restarted: restarted.to_vec(),
        log_records: records.len() as u64,
        reinstalled: 0,
        locks_rolled_forward: 0,
        locks_rolled_back: 0,
        claims_settled: 0,
        blocks_scanned: 0,
        oracle_from: None,
        took: Duration::ZERO,
    };
    let mut plan = PersistPlan::default();
    for record in &records {
        for entry in &record.entries {
            let table = tables.get(&entry.table).ok_or_else(|| {
                TxnError::Invalid(format!(
                    "commit {} writes table {}, which the catalog lacks",
                    record.cid, entry.table
                ))
            })?;
            let part = entry.part as usize;
            let p = table.partitions.get(part).ok_or_else(|| {
                TxnError::Invalid(format!(
                    "commit {} writes partition {part} of table {}, which has {}",
                    record.cid,
                    table.name,
                    table.partitions.len()
                ))
            })?;
            if !restarted.contains(&p.server) {
                continue;
            }
            if reinstall(&mut conns, table, part, record, entry, &mut plan)? {
                report.reinstalled += 1;
            }
        }
    }
    let mut max_cid = records.last().map_or(0, |r| r.cid);
    if server0 {
        let by_cid: HashMap<u64, &LogRecord> = records.iter().map(|r| (r.cid, r)).collect();
        // Every ring is free for reuse after this, so what the records wrote on the
        // servers that kept their memory is persisted too (see [`Written`]).
        let written = Written::by(records.iter());
        for table in tables.values() {
            for part in 0..table.partitions.len() {
                let mut held = Vec::new();
                report.blocks_scanned +=
                    scan_headers(&mut conns, table, part, &mut |addr, word, raw| {
                        let h = Header::decode(word);
                        max_cid = max_cid.max(h.cid);
                        if h.locked {
                            held.push((addr, h.cid, raw.to_vec()));
                        } else if let Some((key, kind)) = written.get(table.id, part, addr) {
                            add_written(&mut plan, table, part, addr, key, kind);
                        }
                        Ok(())
                    })?;
                for (addr, cid, raw) in held {
                    let record = by_cid.get(&cid).copied();
                    let patience = 2 * db.shared.options.oracle.lease_timeout;
                    if resolve(&mut conns, table, part, addr, cid, &raw, record, patience)? {
                        report.locks_rolled_forward += 1;
                    } else {
                        report.locks_rolled_back += 1;
                    }
                    let key = layout::key_word(&raw);
                    add_insert(&mut plan, table, part, addr, key);
                }
            }
        }
    }
    db.shared
        .durability
        .persist_blocking(std::mem::take(&mut plan))?;
    // A restarted server may keep an index slot claimed without an address and lose
    // the claimer's block (an insert into the same bucket persisted the bucket, and
    // nothing persists a block before its commit installs): no lock names that
    // claimer, so no resolve settles the slot, and every lookup of the key would wait
    // on it until one found it pending past the lock patience. Nobody uses the
    // database before the repair ends and no block a restart restores is locked, so
    // every such claim on a restarted server is an orphan: settled here, as that
    // lookup would ([`crate::Database::settle_pending_claim`]).
    for table in tables.values() {
        for (part, p) in table.partitions.iter().enumerate() {
            if !restarted.contains(&p.server) {
                continue;
            }
            for key in unpublished_keys(&mut conns[p.server], p)? {
                if settle_pending(db, &mut conns, table, part, key)? == PendingClaim::Settled {
                    report.claims_settled += 1;
                }
            }
        }
    }
    if server0 {
        let start = max_cid + 1;
        let image: Vec<u8> = oracle
            .layout
            .image_from(start)
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let server = oracle.server as usize;
        conns[server].write_bytes(oracle.data.at(oracle.offset), &image)?;
        plan.add(
            server,
            crate::durable::PersistRange::plain(oracle.data.at(oracle.offset), image.len() as u64),
        );
        let clean = Guard::Clean { tag: 0 }.encode().to_le_bytes();
        for slot in 0..log.slots {
            conns[commitlog::SERVER].write_bytes(log.guard(slot), &clean)?;
            plan.add(
                commitlog::SERVER,
                crate::durable::PersistRange::plain(log.guard(slot), 8),
            );
        }
        db.shared.durability.persist_blocking(plan)?;
        report.oracle_from = Some(start);
    }
    drop(conns);
    report.took = started.elapsed();
    tracing::info!(
        restarted = ?report.restarted,
        log_records = report.log_records,
        reinstalled = report.reinstalled,
        locks_rolled_forward = report.locks_rolled_forward,
        locks_rolled_back = report.locks_rolled_back,
        claims_settled = report.claims_settled,
        oracle_from = ?report.oracle_from,
        took = ?report.took,
        "repaired the cluster after a memory-server restart"
    );
    Ok(report)
}

/// Rolls one logged write forward on a restarted server unless the block already
/// holds its CID or a later one. Returns whether it wrote the block.
fn reinstall(
    conns: &mut [Conn],
    table: &Arc<Table>,
    part: usize,
    record: &LogRecord,
    entry: &commitlog::LogEntry,
    plan: &mut PersistPlan,
) -> Result<bool> {
    let p = &table.partitions[part];
    let shape = table.shape;
    let cid = record.cid;
    let conn = &mut conns[p.server];
    let at = p.data.at(entry.addr);
    if entry.kind == EntryKind::Insert {
        // What makes the block reachable, whatever the block's state.
        let i = (entry.addr - p.arena - 8) / shape.block_bytes();
        let counter = conn.read_word(p.data.at(p.arena))?;
        if counter <= i {
            conn.cas(p.data.at(p.arena), counter, i + 1)?;
        }
        ensure_indexed(conn, &p.index, entry.key, entry.addr)?;
        add_insert(plan, table, part, entry.addr, entry.key);
    }
    let raw = conn.read_bytes(at, shape.block_bytes())?;
    let header = Header::decode(layout::header_word(&raw));
    if header.locked || header.cid >= cid {
        // A lock is resolved with every other (server 0 restarted) or belongs to a
        // commit still running on a server that kept its memory.
        return Ok(false);
    }
    match entry.kind {
        EntryKind::Insert => {
            let block = Block::inserted(
                Header::unlocked(cid),
                entry.key,
                cid,
                entry.value.clone(),
                shape,
            );
            conn.write_bytes(at, &layout::encode(&block, shape)?)?;
        }
        EntryKind::Update | EntryKind::Delete => {
            let value = (entry.kind == EntryKind::Update).then_some(entry.value.as_slice());
            let mut bytes = vec![0u8; (shape.block_bytes() - VERSIONS_OFFSET) as usize];
            layout::write_installed(&raw, cid, value, shape, &mut bytes)?;
            conn.write_bytes(p.data.at(entry.addr + VERSIONS_OFFSET), &bytes)?;
            conn.cas(at, header.encode(), Header::unlocked(cid).encode())?;
        }
    }
    add_block(plan, table, part, entry.addr);
    Ok(true)
}

/// Makes `key` map to `addr` in `index` (a restart may have lost the entry, or kept
/// it half inserted).
fn ensure_indexed(conn: &mut Conn, index: &RemoteIndex, key: u64, addr: u64) -> Result<()> {
    let (bucket, len) = index.bucket_range(key);
    let bytes = conn.read_bytes(bucket, len)?;
    restore_slot(conn, index, key, addr, &bytes)
}

/// [`ensure_indexed`] on the bucket as read into `bucket`. The repair runs alone, so
/// the slot it chose cannot change before its CASes; if one did (another process used
/// the database meanwhile), that is an error, not an address written into a slot that
/// may be another key's.
fn restore_slot(
    conn: &mut Conn,
    index: &RemoteIndex,
    key: u64,
    addr: u64,
    bucket: &[u8],
) -> Result<()> {
    let tag = RemoteIndex::key_word(key)
        .map_err(|_| TxnError::Invalid(format!("key {key} is reserved")))?;
    let Some((i, slot)) = RemoteIndex::locate(crate::index::slots_in_bytes(bucket), key) else {
        return Err(TxnError::Invalid(format!(
            "the index bucket of key {key} is full: its entry cannot be restored"
        )));
    };
    let slot_at = index.slot_at(key, i);
    let address = RemoteIndex::address_word(addr);
    let changed = |word: &str, was: u64| {
        TxnError::Invalid(format!(
            "the {word} word of key {key}'s index slot changed during the restart repair \
             (now {was:#x}): another process used the database before the repair ended"
        ))
    };
    match slot {
        Slot::Published { addr: indexed, .. } if indexed != addr => {
            return Err(TxnError::Invalid(format!(
                "key {key} is indexed at block {indexed}, its log record says {addr}"
            )));
        }
        Slot::Published { .. } => return Ok(()),
        Slot::Empty => {
            let was = conn.cas(index.key_word_at(slot_at), 0, tag)?;
            if was != 0 {
                return Err(changed("key", was));
            }
        }
        Slot::Claimed { .. } => {}
    }
    let was = conn.cas(index.address_word_at(slot_at), 0, address)?;
    if was != 0 && was != address {
        return Err(changed("address", was));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{IndexShape, slots_in_bytes};
    use fabric::sim::{SimConfig, SimNetwork};
    use fabric::{Access, Device};

    /// What keeps the sim server's region and connection up.
    type Keep = (fabric::Region, Arc<dyn fabric::QueuePair>, SimNetwork);

    /// An index of one bucket on a sim server and a connection to it.
    fn one_bucket() -> (RemoteIndex, Conn, Keep) {
        let net = SimNetwork::new(SimConfig::default());
        let server: Arc<dyn Device> = net.add_node();
        let shape = IndexShape {
            buckets: 1,
            slots: 4,
        };
        let region = server.register(shape.region_bytes(), Access::ALL).unwrap();
        let index = RemoteIndex {
            region: region.remote(),
            base: 0,
            shape,
        };
        let dev: Arc<dyn Device> = net.add_node();
        let ccq = dev.create_cq(64).unwrap();
        let scq = server.create_cq(64).unwrap();
        let (sqp, qp) = fabric::connect_rc((server.as_ref(), &scq), (dev.as_ref(), &ccq)).unwrap();
        let conn = Conn::new(dev.as_ref(), qp, ccq, 4096).unwrap();
        (index, conn, (region, sqp, net))
    }

    fn slots(conn: &mut Conn, index: &RemoteIndex) -> Vec<Slot> {
        let (bucket, len) = index.bucket_range(7);
        slots_in_bytes(&conn.read_bytes(bucket, len).unwrap()).collect()
    }

    /// A slot taken by someone else between the repair's read of the bucket and its
    /// CASes is an error, and the other key's slot keeps what it holds. Before, the
    /// repair ignored its claim's CAS and wrote its address into the slot anyway:
    /// key 9's claim became key 9 published at key 7's block.
    #[test]
    fn a_slot_taken_after_the_repair_read_its_bucket_is_left_alone() {
        let (index, mut conn, _keep) = one_bucket();
        let (bucket, len) = index.bucket_range(7);
        let read = conn.read_bytes(bucket, len).unwrap();
        let first = index.slot_at(9, 0);
        let key_9 = RemoteIndex::key_word(9).unwrap();
        conn.cas(index.key_word_at(first), 0, key_9).unwrap();
        let err = restore_slot(&mut conn, &index, 7, 4096, &read).unwrap_err();
        assert!(
            err.to_string()
                .contains("the key word of key 7's index slot changed during the restart repair"),
            "{err}"
        );
        assert_eq!(slots(&mut conn, &index)[0], Slot::Claimed { key: 9 });

        // Key 9 published meanwhile at another block than its log record says.
        let read = conn.read_bytes(bucket, len).unwrap();
        conn.cas(
            index.address_word_at(first),
            0,
            RemoteIndex::address_word(512),
        )
        .unwrap();
        let err = restore_slot(&mut conn, &index, 9, 1024, &read).unwrap_err();
        assert!(err.to_string().contains("address word"), "{err}");
        assert_eq!(
            slots(&mut conn, &index)[0],
            Slot::Published { key: 9, addr: 512 }
        );

        // Read afresh, the repair restores key 7 in the next slot, and once more is
        // a no-op.
        for _ in 0..2 {
            let read = conn.read_bytes(bucket, len).unwrap();
            restore_slot(&mut conn, &index, 7, 4096, &read).unwrap();
            assert_eq!(
                slots(&mut conn, &index)[..2],
                [
                    Slot::Published { key: 9, addr: 512 },
                    Slot::Published { key: 7, addr: 4096 }
                ]
            );
        }
    }
}
