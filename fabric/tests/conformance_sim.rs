//! The conformance suite on the sim backend, plain and with every fault injected.
#![cfg(not(fabric_loom))]

use fabric::Device;
use fabric::conformance::Backend;
use fabric::sim::{CostModel, Faults, SimConfig, SimNetwork};
use std::sync::Arc;

struct Sim(SimConfig);

impl Backend for Sim {
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>> {
        let net = SimNetwork::new(self.0.clone());
        (0..nodes)
            .map(|_| net.add_node() as Arc<dyn Device>)
            .collect()
    }
    fn ud_may_drop(&self) -> bool {
        self.0.faults.ud_drop_probability > 0.0
    }
    fn injects_tears(&self) -> bool {
        self.0.faults.tear_probability > 0.0
    }
}

mod plain {
    use super::*;
    fabric::conformance_tests!(Sim(SimConfig::default()));
}

mod faults {
    use super::*;
    fabric::conformance_tests!(Sim(SimConfig {
        faults: Faults::aggressive(),
        seed: 7,
        ..SimConfig::default()
    }));
}

mod lossy {
    use super::*;
    fabric::conformance_tests!(Sim(SimConfig {
        faults: Faults {
            ud_drop_probability: 0.2,
            ..Faults::aggressive()
        },
        seed: 11,
        ..SimConfig::default()
    }));
}

mod fdr4x {
    use super::*;
    fabric::conformance_tests!(Sim(SimConfig {
        cost: Some(CostModel::FDR4X),
        ..SimConfig::default()
    }));
}
