//! The bank workload and its invariant: money moves between accounts but the total
//! never changes, so every consistent snapshot of all accounts sums to it.

use super::{Action, Script, TxnProgram, Workload};
use crate::anomaly::{AnomalyKind, Explained, Findings};
use crate::history::ReadValue;
use crate::index::{HistoryIndex, Seen};
use rand::Rng;
use rand::rngs::StdRng;

/// `accounts` accounts of `initial_balance` each. A transfer reads two accounts and,
/// if the source can afford it, moves up to `max_transfer` between them; an audit
/// reads every account.
pub struct Bank {
    pub accounts: usize,
    pub initial_balance: i64,
    pub max_transfer: i64,
    pub audit_fraction: f64,
    /// Transfers that end in a voluntary abort (after their writes).
    pub abort_fraction: f64,
}

impl Default for Bank {
    fn default() -> Self {
        Bank {
            accounts: 5,
            initial_balance: 100,
            max_transfer: 10,
            audit_fraction: 0.3,
            abort_fraction: 0.05,
        }
    }
}

impl Bank {
    pub fn account(i: usize) -> String {
        format!("acct{i}")
    }

    pub fn total(&self) -> i64 {
        self.initial_balance * self.accounts as i64
    }

    /// Checks the invariant on a history of this workload:
    ///
    /// - a transaction that read every account saw them sum to the total
    ///   (`bank-total`), whatever its outcome: its reads came from one snapshot;
    /// - a committed transaction that wrote accounts it had read left their sum
    ///   unchanged (`bank-not-conserved`);
    /// - no balance read or written is negative (`negative-balance`).
    pub fn check(&self, index: &HistoryIndex, findings: &mut Findings) {
        let accounts: Vec<Option<u32>> = (0..self.accounts)
            .map(|i| index.key_id(&Bank::account(i)))
            .collect();
        for (t, meta) in index.txns.iter().enumerate() {
            let t = t as u32;
            // Each account's balance as this transaction's snapshot showed it.
            let mut seen: Vec<Option<i64>> = vec![None; self.accounts];
            for read in index.txn_reads(t) {
                let Some(a) = accounts.iter().position(|&k| k == Some(read.key)) else {
                    continue;
                };
                let balance = match read.seen {
                    Seen::Value(v) => v,
                    Seen::Absent => 0,
                    _ => continue,
                };
                seen[a].get_or_insert(balance);
                if balance < 0 {
                    findings.add(AnomalyKind::NegativeBalance, || {
                        Explained::new(
                            format!("T{} read {}={balance}", meta.id, Bank::account(a)),
                            vec![meta.id],
                        )
                    });
                }
            }
            if seen.iter().all(Option::is_some) {
                let sum: i64 = seen.iter().flatten().sum();
                if sum != self.total() {
                    findings.add(AnomalyKind::BankTotal, || {
                        let balances: Vec<String> =
                            seen.iter().flatten().map(i64::to_string).collect();
                        Explained::new(
                            format!(
                                "T{} read balances [{}] summing to {sum}, not {}",
                                meta.id,
                                balances.join(", "),
                                self.total()
                            ),
                            vec![meta.id],
                        )
                    });
                }
            }
            if !meta.committed {
                continue;
            }
            let mut change = 0;
            let mut judged = true;
            for write in index.txn_writes(t).iter().filter(|w| w.last_in_txn) {
                let Some(a) = accounts.iter().position(|&k| k == Some(write.key)) else {
                    continue;
                };
                if write.value < 0 {
                    findings.add(AnomalyKind::NegativeBalance, || {
                        Explained::new(
                            format!("T{} wrote {}={}", meta.id, Bank::account(a), write.value),
                            vec![meta.id],
                        )
                    });
                }
                match seen[a] {
                    Some(before) => change += write.value - before,
                    None => judged = false,
                }
            }
            if judged && change != 0 {
                findings.add(AnomalyKind::BankNotConserved, || {
                    Explained::new(
                        format!("T{} changed the total by {change}", meta.id),
                        vec![meta.id],
                    )
                });
            }
        }
    }
}

impl Workload for Bank {
    fn setup(&self) -> Option<Box<dyn TxnProgram>> {
        let writes =
            (0..self.accounts).map(|i| Action::Write(Bank::account(i), self.initial_balance));
        Some(Box::new(Script::new(writes.chain([Action::Commit]))))
    }

    fn next_txn(&self, rng: &mut StdRng) -> Box<dyn TxnProgram> {
        if self.accounts < 2 || rng.random_bool(self.audit_fraction) {
            let reads = (0..self.accounts).map(|i| Action::Read(Bank::account(i)));
            return Box::new(Script::new(reads.chain([Action::Commit])));
        }
        let from = rng.random_range(0..self.accounts);
        let to = (from + rng.random_range(1..self.accounts)) % self.accounts;
        Box::new(Transfer {
            from: Bank::account(from),
            to: Bank::account(to),
            amount: rng.random_range(1..=self.max_transfer.max(1)),
            abort: rng.random_bool(self.abort_fraction),
            step: TransferStep::ReadFrom,
        })
    }
}

struct Transfer {
    from: String,
    to: String,
    amount: i64,
    abort: bool,
    step: TransferStep,
}

enum TransferStep {
    ReadFrom,
    ReadTo,
    WriteFrom { from: i64 },
    WriteTo { to: i64 },
    Finish,
}

fn balance(read: Option<&ReadValue>) -> i64 {
    match read {
        Some(ReadValue::Register(v)) => *v,
        _ => 0,
    }
}

impl TxnProgram for Transfer {
    fn next(&mut self, last_read: Option<&ReadValue>) -> Action {
        let (step, action) = match self.step {
            TransferStep::ReadFrom => (TransferStep::ReadTo, Action::Read(self.from.clone())),
            TransferStep::ReadTo => {
                let from = balance(last_read);
                (
                    TransferStep::WriteFrom { from },
                    Action::Read(self.to.clone()),
                )
            }
            TransferStep::WriteFrom { from } if from < self.amount => {
                (TransferStep::Finish, Action::Commit)
            }
            TransferStep::WriteFrom { from } => {
                let to = balance(last_read);
                (
                    TransferStep::WriteTo { to },
                    Action::Write(self.from.clone(), from - self.amount),
                )
            }
            TransferStep::WriteTo { to } => (
                TransferStep::Finish,
                Action::Write(self.to.clone(), to + self.amount),
            ),
            TransferStep::Finish if self.abort => (TransferStep::Finish, Action::Abort),
            TransferStep::Finish => (TransferStep::Finish, Action::Commit),
        };
        self.step = step;
        action
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Status::*;
    use crate::index::tests::{r, txn, w};

    fn bank() -> Bank {
        Bank {
            accounts: 2,
            initial_balance: 10,
            ..Bank::default()
        }
    }

    fn reg(v: i64) -> ReadValue {
        ReadValue::Register(v)
    }

    fn check(txns: Vec<crate::history::Txn>) -> Vec<(AnomalyKind, u64)> {
        let index = HistoryIndex::from_txns(txns).expect("indexes");
        let mut findings = Findings::default();
        bank().check(&index, &mut findings);
        findings.iter().map(|(k, f)| (k, f.count)).collect()
    }

    #[test]
    fn conserving_transfers_and_exact_audits_pass() {
        let found = check(vec![
            txn(1, Committed, vec![w("acct0", 10), w("acct1", 10)]),
            txn(
                2,
                Committed,
                vec![
                    r("acct0", reg(10)),
                    r("acct1", reg(10)),
                    w("acct0", 7),
                    w("acct1", 13),
                ],
            ),
            txn(3, Committed, vec![r("acct0", reg(7)), r("acct1", reg(13))]),
        ]);
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn broken_totals_are_caught() {
        let found = check(vec![
            txn(1, Committed, vec![w("acct0", 10), w("acct1", 10)]),
            // Creates 3 out of nothing.
            txn(
                2,
                Committed,
                vec![
                    r("acct0", reg(10)),
                    r("acct1", reg(10)),
                    w("acct0", 7),
                    w("acct1", 16),
                ],
            ),
            // An aborted audit still read one snapshot: it must add up too.
            txn(3, Aborted, vec![r("acct0", reg(7)), r("acct1", reg(16))]),
            txn(4, Committed, vec![r("acct0", reg(-1)), r("acct1", reg(20))]),
        ]);
        assert_eq!(
            found,
            vec![
                (AnomalyKind::BankTotal, 2),
                (AnomalyKind::BankNotConserved, 1),
                (AnomalyKind::NegativeBalance, 1)
            ]
        );
    }

    #[test]
    fn a_transfer_moves_money_only_when_the_source_can_afford_it() {
        let mut rich = Transfer {
            from: "a".into(),
            to: "b".into(),
            amount: 5,
            abort: false,
            step: TransferStep::ReadFrom,
        };
        assert_eq!(rich.next(None), Action::Read("a".into()));
        assert_eq!(rich.next(Some(&reg(8))), Action::Read("b".into()));
        assert_eq!(rich.next(Some(&reg(1))), Action::Write("a".into(), 3));
        assert_eq!(rich.next(None), Action::Write("b".into(), 6));
        assert_eq!(rich.next(None), Action::Commit);

        let mut poor = Transfer {
            from: "a".into(),
            to: "b".into(),
            amount: 5,
            abort: true,
            step: TransferStep::ReadFrom,
        };
        poor.next(None);
        poor.next(Some(&reg(4)));
        assert_eq!(poor.next(Some(&reg(0))), Action::Commit);
    }
}
