//! What a device rejects at post time, before any work request executes: the same
//! rules for every software backend.

use crate::addr::NodeId;
use crate::device::QpKind;
use crate::error::{FabricError, Result};
use crate::wr::{SendWr, Src, WrOp};

/// Checks what the device rejects at post time (`ibv_post_send` returning EINVAL).
pub(crate) fn validate(
    kind: QpKind,
    peer: Option<NodeId>,
    max_inline: u32,
    wr: &SendWr<'_>,
) -> Result<()> {
    let bad = |m: String| Err(FabricError::InvalidWorkRequest(m));
    match kind {
        QpKind::Ud => {
            if !matches!(wr.op, WrOp::Send { .. }) {
                return bad(format!(
                    "{:?} is not available on a UD queue pair",
                    wr.op.opcode()
                ));
            }
            if wr.dest.is_none() {
                return bad("a UD send needs a destination".into());
            }
        }
        QpKind::Rc => {
            if wr.dest.is_some() {
                return bad("an RC work request must not carry a UD destination".into());
            }
            if let (Some((remote, _)), Some(peer)) = (wr.op.remote_span(), peer)
                && remote.node != peer
            {
                return bad(format!(
                    "remote address is on {} but the queue pair is connected to {}",
                    remote.node, peer
                ));
            }
        }
    }
    match wr.op {
        WrOp::Write {
            local: Src::Inline(d),
            ..
        }
        | WrOp::Send {
            local: Src::Inline(d),
            ..
        } if d.len() > max_inline as usize => bad(format!(
            "{} bytes of inline data exceed max_inline {}",
            d.len(),
            max_inline
        )),
        WrOp::Cas { local, .. } | WrOp::FetchAdd { local, .. } if local.len != 8 => bad(format!(
            "an atomic's result buffer is 8 bytes, got {}",
            local.len
        )),
        _ => Ok(()),
    }
}
