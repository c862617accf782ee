//! Partial aggregation states and the open-addressing tables that hold them.
//!
//! One [`State`] per group covers every aggregate of a query at once: SUM and AVG's
//! sum (an `i128`, so no sum of `i64` values can overflow), COUNT (AVG's count too),
//! MIN and MAX. States merge by adding sums and counts and taking the smaller minimum
//! and the larger maximum, so a partial state computed anywhere (a worker's local
//! table, an RDMA AGG cache table, another partial) merges into the owner's state
//! with the same result as folding the raw tuples there.
//!
//! [`GroupTable`] is linear probing over one array of slots. A slot with count 0 is
//! empty (a present group has count ≥ 1), so every `u64` is a valid key and no
//! sentinel is needed. Tables grow by doubling, at a quarter full while they fit a
//! core's L2 and at 5/8 beyond ([`SPARSE_UP_TO`]); bounded use (a memory budget, a
//! cache-sized table) goes through [`GroupTable::try_add`], which never inserts past
//! a limit.

/// The hash of a group key: a folded 128-bit multiply. Its high bits pick the owner
/// node ([`owner`]) and its low bits the slot, so the groups an owner receives still
/// spread over its whole table.
#[inline]
pub fn hash(key: u64) -> u64 {
    let p = u128::from(key ^ 0x243f_6a88_85a3_08d3) * 0x9e37_79b9_7f4a_7c15_u128;
    (p as u64) ^ ((p >> 64) as u64)
}

/// The node that owns the group of hash `h`: `⌊h·nodes / 2⁶⁴⌋`, a multiply instead of
/// a division per tuple.
#[inline]
pub fn owner(h: u64, nodes: usize) -> usize {
    ((u128::from(h) * nodes as u128) >> 64) as usize
}

/// The partial state of one group for SUM, COUNT, AVG, MIN and MAX.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State {
    pub count: u64,
    pub min: i64,
    pub max: i64,
    pub sum: i128,
}

impl State {
    /// The state of one tuple.
    #[inline]
    pub fn of(value: i64) -> State {
        State {
            count: 1,
            min: value,
            max: value,
            sum: i128::from(value),
        }
    }

    #[inline]
    pub fn add(&mut self, value: i64) {
        self.count += 1;
        self.sum += i128::from(value);
        self.min = self.min.min(value);
        self.max = self.max.max(value);
    }

    #[inline]
    pub fn merge(&mut self, other: &State) {
        self.count += other.count;
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    /// AVG as a float (the exact value is `sum / count`).
    pub fn avg(&self) -> f64 {
        self.sum as f64 / self.count as f64
    }
}

/// One slot: a key and its state; `count == 0` marks it empty. 48 bytes.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Slot {
    key: u64,
    count: u64,
    min: i64,
    max: i64,
    sum: i128,
}

impl Slot {
    #[inline]
    fn state(&self) -> State {
        State {
            count: self.count,
            min: self.min,
            max: self.max,
            sum: self.sum,
        }
    }
    #[inline]
    fn set(&mut self, key: u64, s: &State) {
        *self = Slot {
            key,
            count: s.count,
            min: s.min,
            max: s.max,
            sum: s.sum,
        };
    }
}

/// Groups keyed by `u64`, each with a [`State`].
pub struct GroupTable {
    slots: Vec<Slot>,
    mask: usize,
    len: usize,
    /// The table grows when `len` reaches this ([`grow_at`]).
    grow_at: usize,
}

/// Tables of up to this many slots (1.5 MiB, within a core's L2) are kept at most a
/// quarter full, larger ones at most 5/8. A cache-resident table's cost is the probe
/// loop's branch: at a quarter full nearly every lookup ends at its first slot, and
/// Two Phase over 1 000 groups ran twice as fast as at half full. A table that does
/// not fit the cache pays a miss per lookup either way, so there memory wins.
const SPARSE_UP_TO: usize = 1 << 15;

/// The groups a table of `slots` slots holds before it grows.
fn grow_at(slots: usize) -> usize {
    if slots <= SPARSE_UP_TO {
        slots / 4
    } else {
        slots / 8 * 5
    }
}

impl GroupTable {
    /// A table that holds `groups` groups without growing.
    pub fn with_capacity(groups: usize) -> GroupTable {
        let mut slots: usize = 16;
        // Bounded so that the doubling cannot wrap: a larger request gets the largest
        // table an address space could hold, and the allocation fails there.
        while grow_at(slots) < groups && slots < 1 << (usize::BITS - 8) {
            slots *= 2;
        }
        GroupTable {
            slots: vec![Slot::default(); slots],
            mask: slots - 1,
            len: 0,
            grow_at: grow_at(slots),
        }
    }

    /// Groups held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the slot array.
    pub fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }

    /// The slot of `key` (hash `h`): `Ok` where it is, `Err` the empty slot where it
    /// would go.
    #[inline]
    fn find(&self, key: u64, h: u64) -> Result<usize, usize> {
        let mut i = h as usize & self.mask;
        loop {
            let s = &self.slots[i];
            if s.count == 0 {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Folds one tuple into its group (hash `h`), growing the table as needed.
    #[inline]
    pub fn add(&mut self, key: u64, h: u64, value: i64) {
        // No table holds usize::MAX groups: this always folds.
        self.try_add(key, h, value, usize::MAX);
    }

    /// Folds one tuple into its group unless that would make the table hold more than
    /// `limit` groups; `false` (and nothing changed) then.
    #[inline]
    pub fn try_add(&mut self, key: u64, h: u64, value: i64, limit: usize) -> bool {
        match self.find(key, h) {
            Ok(i) => {
                let s = &mut self.slots[i];
                s.count += 1;
                s.sum += i128::from(value);
                s.min = s.min.min(value);
                s.max = s.max.max(value);
                true
            }
            Err(_) if self.len >= limit => false,
            Err(i) => {
                self.insert_at(i, key, h, &State::of(value));
                true
            }
        }
    }

    /// Merges a partial state into its group (hash `h`).
    #[inline]
    pub fn merge(&mut self, key: u64, h: u64, state: &State) {
        match self.find(key, h) {
            Ok(i) => {
                let mut s = self.slots[i].state();
                s.merge(state);
                self.slots[i].set(key, &s);
            }
            Err(i) => self.insert_at(i, key, h, state),
        }
    }

    #[inline]
    fn insert_at(&mut self, i: usize, key: u64, h: u64, state: &State) {
        if self.len >= self.grow_at {
            self.grow();
            let i = self.find(key, h).expect_err("the key is absent");
            self.slots[i].set(key, state);
        } else {
            self.slots[i].set(key, state);
        }
        self.len += 1;
    }

    #[cold]
    fn grow(&mut self) {
        let bigger = self.slots.len() * 2;
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); bigger]);
        self.mask = bigger - 1;
        self.grow_at = grow_at(bigger);
        for s in old.into_iter().filter(|s| s.count != 0) {
            let i = self.find(s.key, hash(s.key)).expect_err("keys are unique");
            self.slots[i] = s;
        }
    }

    /// The state of `key`.
    pub fn get(&self, key: u64) -> Option<State> {
        self.find(key, hash(key))
            .ok()
            .map(|i| self.slots[i].state())
    }

    /// Every group and its state, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, State)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.count != 0)
            .map(|s| (s.key, s.state()))
    }

    /// Merges every group of `other` into this table.
    pub fn absorb(&mut self, other: &GroupTable) {
        for (k, s) in other.iter() {
            self.merge(k, hash(k), &s);
        }
    }

    /// Forgets every group, keeping the memory.
    pub fn clear(&mut self) {
        if self.len != 0 {
            self.slots.fill(Slot::default());
            self.len = 0;
        }
    }
}

/// Distinct keys, counted up to a cap: what the sampling choice and Adaptive
/// Repartitioning's observation use to tell few groups from many.
pub struct KeySet {
    keys: Vec<u64>,
    used: Vec<bool>,
    mask: usize,
    len: usize,
    cap: usize,
}

impl KeySet {
    /// Counts up to `cap` distinct keys; beyond that it only reports that the cap was
    /// reached.
    ///
    /// It starts small and doubles at half full: a cap of the memory budget is a
    /// megabyte or more, which a few groups never need, and a large allocation freed
    /// again raises glibc's mmap threshold, which moved the next table onto the heap
    /// and slowed Adaptive Repartitioning's local phase on one node by a fifth.
    pub fn new(cap: usize) -> KeySet {
        let slots = (cap.clamp(4, 512) * 2).next_power_of_two();
        KeySet {
            keys: vec![0; slots],
            used: vec![false; slots],
            mask: slots - 1,
            len: 0,
            cap,
        }
    }

    /// Distinct keys seen, at most the cap.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn full(&self) -> bool {
        self.len >= self.cap
    }

    /// Records `key` unless the cap was reached; `h` is [`hash`]`(key)`.
    #[inline]
    pub fn insert(&mut self, key: u64, h: u64) {
        if self.full() {
            return;
        }
        let mut i = h as usize & self.mask;
        while self.used[i] {
            if self.keys[i] == key {
                return;
            }
            i = (i + 1) & self.mask;
        }
        self.used[i] = true;
        self.keys[i] = key;
        self.len += 1;
        if self.len * 2 >= self.keys.len() && !self.full() {
            self.grow();
        }
    }

    #[cold]
    fn grow(&mut self) {
        let slots = self.keys.len() * 2;
        let keys = std::mem::replace(&mut self.keys, vec![0; slots]);
        let used = std::mem::replace(&mut self.used, vec![false; slots]);
        self.mask = slots - 1;
        for (k, _) in keys.into_iter().zip(used).filter(|&(_, u)| u) {
            let mut i = hash(k) as usize & self.mask;
            while self.used[i] {
                i = (i + 1) & self.mask;
            }
            self.used[i] = true;
            self.keys[i] = k;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn reference(tuples: &[(u64, i64)]) -> BTreeMap<u64, State> {
        let mut m: BTreeMap<u64, State> = BTreeMap::new();
        for &(k, v) in tuples {
            m.entry(k).and_modify(|s| s.add(v)).or_insert(State::of(v));
        }
        m
    }

    fn contents(t: &GroupTable) -> BTreeMap<u64, State> {
        t.iter().collect()
    }

    fn tuples(n: u64, groups: u64) -> Vec<(u64, i64)> {
        (0..n)
            .map(|i| {
                let k = crate::testing::mix(i) % groups;
                // Keys 0 and u64::MAX are ordinary keys.
                let k = if k == 1 { u64::MAX } else { k };
                (k, (crate::testing::mix(i ^ 77) % 2001) as i64 - 1000)
            })
            .collect()
    }

    #[test]
    fn a_growing_table_holds_what_a_map_holds() {
        let data = tuples(20_000, 3_000);
        let mut t = GroupTable::with_capacity(1);
        for &(k, v) in &data {
            t.add(k, hash(k), v);
        }
        let want = reference(&data);
        assert_eq!(t.len(), want.len());
        assert_eq!(contents(&t), want);
        assert_eq!(t.get(u64::MAX), want.get(&u64::MAX).copied());
        assert_eq!(t.get(123_456_789), None);
    }

    #[test]
    fn cache_sized_tables_stay_a_quarter_full_and_large_ones_five_eighths() {
        let slot = std::mem::size_of::<Slot>();
        let mut t = GroupTable::with_capacity(1000);
        assert_eq!(t.memory_bytes(), 4096 * slot);
        for k in 0..1024u64 {
            t.add(k, hash(k), 1);
        }
        assert_eq!(t.memory_bytes(), 4096 * slot, "1024 groups fit 4096 slots");
        t.add(1024, hash(1024), 1);
        assert_eq!(t.memory_bytes(), 8192 * slot, "the 1025th doubles it");
        // Past SPARSE_UP_TO slots the table fills to 5/8 before it doubles.
        let mut big = GroupTable::with_capacity(SPARSE_UP_TO / 4 + 1);
        assert_eq!(big.memory_bytes(), 2 * SPARSE_UP_TO * slot);
        for k in 0..(2 * SPARSE_UP_TO / 8 * 5) as u64 {
            big.add(k, hash(k), 1);
        }
        assert_eq!(big.memory_bytes(), 2 * SPARSE_UP_TO * slot);
        assert_eq!(big.len(), 2 * SPARSE_UP_TO / 8 * 5);
    }

    #[test]
    fn partials_merge_like_the_whole() {
        let data = tuples(10_000, 500);
        let mut merged = GroupTable::with_capacity(8);
        for part in data.chunks(777) {
            let mut p = GroupTable::with_capacity(8);
            for &(k, v) in part {
                p.add(k, hash(k), v);
            }
            merged.absorb(&p);
        }
        assert_eq!(contents(&merged), reference(&data));
    }

    #[test]
    fn a_bounded_table_refuses_new_groups_at_its_limit_only() {
        let mut t = GroupTable::with_capacity(4);
        for k in 0..4u64 {
            assert!(t.try_add(k, hash(k), -1, 4));
        }
        assert!(!t.try_add(9, hash(9), 5, 4));
        assert!(t.try_add(2, hash(2), 7, 4), "a present group still folds");
        assert_eq!(t.len(), 4);
        assert_eq!(t.get(9), None);
        let s = t.get(2).unwrap();
        assert_eq!((s.count, s.min, s.max, s.sum), (2, -1, 7, 6));
        t.clear();
        assert!(t.is_empty() && t.get(2).is_none());
    }

    #[test]
    fn sums_do_not_overflow_and_extremes_survive() {
        let mut t = GroupTable::with_capacity(1);
        for v in [i64::MAX, i64::MAX, i64::MIN, i64::MAX] {
            t.add(5, hash(5), v);
        }
        let s = t.get(5).unwrap();
        assert_eq!(s.sum, 2 * i128::from(i64::MAX) - 1);
        assert_eq!((s.min, s.max, s.count), (i64::MIN, i64::MAX, 4));
    }

    #[test]
    fn a_key_set_counts_distinct_keys_up_to_its_cap() {
        let mut s = KeySet::new(100);
        for i in 0..1000u64 {
            s.insert(i % 40, hash(i % 40));
        }
        assert_eq!(s.len(), 40);
        assert!(!s.full());
        for i in 0..1000u64 {
            s.insert(i, hash(i));
        }
        assert_eq!(s.len(), 100);
        assert!(s.full());
    }

    #[test]
    fn a_key_set_grows_past_its_first_slots_and_forgets_no_key() {
        let mut s = KeySet::new(1 << 16);
        let first_slots = s.keys.len();
        for round in 0..3u64 {
            for k in 0..20_000u64 {
                s.insert(k * 7 + 1, hash(k * 7 + 1));
            }
            assert_eq!(s.len(), 20_000, "round {round}");
        }
        assert!(s.keys.len() > first_slots && s.keys.len() <= 2 * (1 << 17));
        assert!(!s.full());
        for k in 0..100_000u64 {
            s.insert(u64::MAX - k, hash(u64::MAX - k));
        }
        assert_eq!(s.len(), 1 << 16);
        assert!(s.full());
    }

    #[test]
    fn owners_spread_keys_over_nodes() {
        let mut per = [0usize; 3];
        for k in 0..30_000u64 {
            per[owner(hash(k), 3)] += 1;
        }
        assert!(per.iter().all(|&n| n > 9_000), "{per:?}");
    }
}
