//! Fabric errors across the remote-verbs service: a refused device call becomes a
//! status whose details are the serialized error, and the client rebuilds the very
//! variant the device returned, so code matching `FabricError::Post { index, .. }` or
//! `InvalidState { state: QpState::Init, .. }` behaves as against a local device.

use crate::proto::{self, fabric_error as pe};
use crate::verbs_wire;
use fabric::{FabricError, NodeId, QpEndpoint};
use prost::Message;
use std::collections::BTreeSet;
use std::sync::Mutex;
use tonic::codegen::Bytes;
use tonic::{Code, Status};

/// The status for a device error: a code a gRPC client of any language can act on,
/// the device's message, and the error itself in the details.
pub(crate) fn to_status(e: &FabricError) -> Status {
    Status::with_details(
        code(e),
        e.to_string(),
        Bytes::from(encode(e).encode_to_vec()),
    )
}

/// The error a status stands for: the device's own when the details carry it,
/// otherwise (no session, verbs disabled, the server unreachable) a backend error
/// that names the call and says what the server said.
pub(crate) fn from_status(method: &str, status: &Status) -> FabricError {
    proto::FabricError::decode(status.details())
        .ok()
        .and_then(|p| decode(&p))
        .unwrap_or_else(|| {
            FabricError::Backend(format!(
                "{method} on the memory server failed: {} ({:?})",
                status.message(),
                status.code()
            ))
        })
}

fn code(e: &FabricError) -> Code {
    match e {
        FabricError::OutOfBounds { .. }
        | FabricError::Misaligned { .. }
        | FabricError::InvalidWorkRequest(_)
        | FabricError::ForeignObject(_) => Code::InvalidArgument,
        FabricError::QueueFull { .. } | FabricError::CqOverrun { .. } => Code::ResourceExhausted,
        FabricError::InvalidState { .. } | FabricError::NotLocal => Code::FailedPrecondition,
        FabricError::Post { source, .. } => code(source),
        FabricError::UnknownPeer(_) => Code::NotFound,
        FabricError::Completion { .. } => Code::Aborted,
        FabricError::Backend(_) => Code::Unknown,
    }
}

fn encode(e: &FabricError) -> proto::FabricError {
    use pe::Error as P;
    let error = match e {
        FabricError::OutOfBounds {
            offset,
            len,
            region_len,
        } => P::OutOfBounds(pe::OutOfBounds {
            offset: *offset,
            len: *len,
            region_len: *region_len,
        }),
        FabricError::Misaligned { offset } => P::Misaligned(*offset),
        FabricError::QueueFull { queue, depth } => P::QueueFull(pe::QueueFull {
            queue: queue.to_string(),
            depth: *depth,
        }),
        FabricError::InvalidState { state, action } => P::InvalidState(pe::InvalidState {
            state: verbs_wire::qp_state(*state) as i32,
            action: action.to_string(),
        }),
        FabricError::InvalidWorkRequest(m) => P::InvalidWorkRequest(m.clone()),
        FabricError::Post { index, source } => P::Post(Box::new(pe::Post {
            index: *index as u64,
            source: Some(Box::new(encode(source))),
        })),
        FabricError::UnknownPeer(at) => P::UnknownPeer(verbs_wire::endpoint(*at)),
        FabricError::CqOverrun { capacity } => P::CqOverrun(*capacity),
        FabricError::ForeignObject(what) => P::ForeignObject(what.to_string()),
        FabricError::Completion { status, index } => P::Completion(pe::CompletionError {
            status: verbs_wire::wc_status(*status) as i32,
            index: *index as u64,
        }),
        FabricError::NotLocal => P::NotLocal(pe::NotLocal {}),
        FabricError::Backend(m) => P::Backend(m.clone()),
    };
    proto::FabricError { error: Some(error) }
}

/// None for details that are not a fabric error this build knows.
fn decode(p: &proto::FabricError) -> Option<FabricError> {
    use pe::Error as P;
    Some(match p.error.as_ref()? {
        P::OutOfBounds(o) => FabricError::OutOfBounds {
            offset: o.offset,
            len: o.len,
            region_len: o.region_len,
        },
        P::Misaligned(offset) => FabricError::Misaligned { offset: *offset },
        P::QueueFull(q) => FabricError::QueueFull {
            queue: intern(&q.queue),
            depth: q.depth,
        },
        P::InvalidState(s) => FabricError::InvalidState {
            state: verbs_wire::qp_state_from(s.state).ok()?,
            action: intern(&s.action),
        },
        P::InvalidWorkRequest(m) => FabricError::InvalidWorkRequest(m.clone()),
        P::Post(post) => FabricError::Post {
            index: usize::try_from(post.index).ok()?,
            source: Box::new(decode(post.source.as_ref()?)?),
        },
        P::UnknownPeer(at) => FabricError::UnknownPeer(QpEndpoint {
            node: NodeId(at.node),
            qpn: at.qpn,
        }),
        P::CqOverrun(capacity) => FabricError::CqOverrun {
            capacity: *capacity,
        },
        P::ForeignObject(what) => FabricError::ForeignObject(intern(what)),
        P::Completion(c) => FabricError::Completion {
            status: verbs_wire::wc_status_from(c.status).ok()?,
            index: usize::try_from(c.index).ok()?,
        },
        P::NotLocal(_) => FabricError::NotLocal,
        P::Backend(m) => FabricError::Backend(m.clone()),
    })
}

/// Distinct strings [`intern`] keeps; later ones get [`UNRECORDED`].
const MAX_INTERNED: usize = 1024;
/// Longer strings are cut, so interning keeps well under a megabyte.
const MAX_INTERNED_LEN: usize = 256;
const UNRECORDED: &str = "(more distinct names than this client records)";

/// `s` as a `&'static str`. A few fabric fields (`QueueFull::queue`,
/// `InvalidState::action`, `ForeignObject`, `Device::backend`) are static because a
/// backend names fixed things; a remote device's names arrive at run time, so each
/// distinct one is leaked once, and only a bounded number of them.
pub(crate) fn intern(s: &str) -> &'static str {
    static INTERNED: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());
    let s = match s.char_indices().nth(MAX_INTERNED_LEN) {
        Some((cut, _)) => &s[..cut],
        None => s,
    };
    // Every update is one insert, so a poisoned set is still a valid one.
    let mut set = INTERNED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(known) = set.get(s) {
        return known;
    }
    if set.len() >= MAX_INTERNED {
        return UNRECORDED;
    }
    let leaked: &'static str = Box::leak(s.to_owned().into_boxed_str());
    set.insert(leaked);
    leaked
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::{QpState, WcStatus};

    fn every_variant() -> Vec<FabricError> {
        vec![
            FabricError::OutOfBounds {
                offset: 1,
                len: 2,
                region_len: 3,
            },
            FabricError::Misaligned { offset: 12 },
            FabricError::QueueFull {
                queue: "send",
                depth: 16,
            },
            FabricError::InvalidState {
                state: QpState::Init,
                action: "posting sends before connect",
            },
            FabricError::InvalidWorkRequest("65 bytes of inline data exceed max_inline 64".into()),
            FabricError::Post {
                index: 3,
                source: Box::new(FabricError::Post {
                    index: 0,
                    source: Box::new(FabricError::QueueFull {
                        queue: "receive",
                        depth: 1,
                    }),
                }),
            },
            FabricError::UnknownPeer(QpEndpoint {
                node: NodeId(4),
                qpn: 5,
            }),
            FabricError::CqOverrun { capacity: 64 },
            FabricError::ForeignObject("completion queue of another backend"),
            FabricError::Completion {
                status: WcStatus::RemoteAccess,
                index: 1,
            },
            FabricError::NotLocal,
            FabricError::Backend("cannot resolve `tcp:nowhere:1`".into()),
        ]
    }

    #[test]
    fn every_variant_round_trips_through_a_status() {
        for e in every_variant() {
            let status = to_status(&e);
            assert_eq!(status.message(), e.to_string());
            assert_eq!(from_status("PostSend", &status), e);
        }
    }

    #[test]
    fn codes_follow_the_error() {
        let queue_full = FabricError::Post {
            index: 0,
            source: Box::new(FabricError::QueueFull {
                queue: "send",
                depth: 1,
            }),
        };
        assert_eq!(to_status(&queue_full).code(), Code::ResourceExhausted);
        let not_ready = FabricError::InvalidState {
            state: QpState::Init,
            action: "x",
        };
        assert_eq!(to_status(&not_ready).code(), Code::FailedPrecondition);
        assert_eq!(
            to_status(&FabricError::Misaligned { offset: 1 }).code(),
            Code::InvalidArgument
        );
    }

    #[test]
    fn statuses_without_a_fabric_error_name_the_call() {
        let e = from_status(
            "CreateQp",
            &Status::permission_denied("remote verbs are disabled"),
        );
        let FabricError::Backend(m) = e else {
            panic!("{e:?}")
        };
        assert!(
            m.contains("CreateQp") && m.contains("disabled") && m.contains("PermissionDenied"),
            "{m}"
        );
        // Details that are not a fabric error (here: one with no case set) are ignored.
        let odd = Status::with_details(
            Code::Internal,
            "odd",
            Bytes::from(proto::FabricError { error: None }.encode_to_vec()),
        );
        assert!(matches!(
            from_status("PollCq", &odd),
            FabricError::Backend(_)
        ));
    }

    #[test]
    fn interning_is_stable_and_bounded_in_length() {
        let a = intern("posting sends before connect");
        let b = intern(&String::from("posting sends before connect"));
        assert!(std::ptr::eq(a, b));
        let long = "x".repeat(10_000);
        assert_eq!(intern(&long).len(), MAX_INTERNED_LEN);
    }
}
