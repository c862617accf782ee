//! The optional latency and bandwidth model of the sim backend.

use std::time::{Duration, Instant};

/// A named network profile. Under a model, a work request's completion becomes visible
/// only once its modelled latency has passed and the sending port has serialised its
/// bytes; data still moves at post time, as a real NIC may land data before the
/// requester sees the completion.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    pub name: &'static str,
    /// One-sided WRITE (and SEND) latency for a small message.
    pub write_latency: Duration,
    /// One-sided READ latency (a round trip).
    pub read_latency: Duration,
    /// CAS / FETCH_ADD latency (a round trip through the responder's atomic unit).
    pub atomic_latency: Duration,
    /// Port bandwidth in bytes per second.
    pub bytes_per_sec: f64,
}

impl CostModel {
    /// InfiniBand FDR 4x, from §2 of the NAM paper (Binnig et al., VLDB 2016): about
    /// 1 µs per small WRITE, about 2 µs per READ (a round trip), 6.8 GB/s per port.
    pub const FDR4X: CostModel = CostModel {
        name: "fdr4x",
        write_latency: Duration::from_nanos(1_000),
        read_latency: Duration::from_nanos(2_000),
        atomic_latency: Duration::from_nanos(2_200),
        bytes_per_sec: 6.8e9,
    };

    /// InfiniBand EDR 4x (100 Gb/s; ConnectX-5 as in the DFI and shuffle papers):
    /// about 12.1 GB/s of payload per port and roughly 0.6 µs one-way small-message
    /// latency, so a READ round trip costs about 1.2 µs.
    pub const EDR4X: CostModel = CostModel {
        name: "edr4x",
        write_latency: Duration::from_nanos(600),
        read_latency: Duration::from_nanos(1_200),
        atomic_latency: Duration::from_nanos(1_400),
        bytes_per_sec: 12.1e9,
    };

    pub const PROFILES: [CostModel; 2] = [CostModel::FDR4X, CostModel::EDR4X];

    /// Looks a profile up by name (`fdr4x`, `edr4x`).
    pub fn by_name(name: &str) -> Option<CostModel> {
        Self::PROFILES
            .iter()
            .copied()
            .find(|p| p.name.eq_ignore_ascii_case(name))
    }

    pub fn serialisation(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec)
    }
}

/// Which latency class a work request falls in.
#[derive(Clone, Copy, Debug)]
pub(crate) enum LatencyClass {
    Write,
    Read,
    Atomic,
}

/// A sending port: work requests leave it one after another at the port's bandwidth.
#[derive(Debug)]
pub(crate) struct Port {
    busy_until: Option<Instant>,
}

impl Port {
    pub(crate) fn new() -> Port {
        Port { busy_until: None }
    }

    /// When a work request of `bytes` posted now completes under `model`.
    pub(crate) fn schedule(
        &mut self,
        model: &CostModel,
        class: LatencyClass,
        bytes: u64,
        now: Instant,
    ) -> Instant {
        let start = match self.busy_until {
            Some(t) if t > now => t,
            _ => now,
        };
        let sent = start + model.serialisation(bytes);
        self.busy_until = Some(sent);
        let latency = match class {
            LatencyClass::Write => model.write_latency,
            LatencyClass::Read => model.read_latency,
            LatencyClass::Atomic => model.atomic_latency,
        };
        sent + latency
    }
}

#[cfg(all(test, not(fabric_loom)))]
mod tests {
    use super::*;

    #[test]
    fn profiles_are_found_by_name() {
        assert_eq!(CostModel::by_name("FDR4X"), Some(CostModel::FDR4X));
        assert_eq!(CostModel::by_name("edr4x"), Some(CostModel::EDR4X));
        assert_eq!(CostModel::by_name("hdr"), None);
    }

    #[test]
    fn port_serialises_back_to_back_transfers() {
        let m = CostModel::FDR4X;
        let mut port = Port::new();
        let now = Instant::now();
        let a = port.schedule(&m, LatencyClass::Write, 68_000, now);
        let b = port.schedule(&m, LatencyClass::Write, 68_000, now);
        // 68 kB at 6.8 GB/s is 10 µs on the wire, plus 1 µs latency.
        assert_eq!(a - now, Duration::from_micros(11));
        assert_eq!(b - now, Duration::from_micros(21));
    }
}
