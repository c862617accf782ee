//! Snapshot scans: every row of a txn table visible at a read timestamp, read from the memory servers with large, selectively signaled READs.
