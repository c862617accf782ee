//! fabric's work requests, completions and states as `remote_verbs.proto` carries
//! them, both ways. Decoding checks every field: the other side may be any gRPC peer.

use crate::proto;
use fabric::{
    Completion, LocalBuf, NodeId, QpEndpoint, QpState, RecvWr, RemoteAddr, SendWr, Src, UdDest,
    WcOpcode, WcStatus, WrOp,
};

pub(crate) fn wc_status(s: WcStatus) -> proto::WcStatus {
    use proto::WcStatus as P;
    match s {
        WcStatus::Success => P::Success,
        WcStatus::LocalLength => P::LocalLength,
        WcStatus::LocalProtection => P::LocalProtection,
        WcStatus::WrFlush => P::WrFlush,
        WcStatus::RemoteInvalidRequest => P::RemoteInvalidRequest,
        WcStatus::RemoteAccess => P::RemoteAccess,
        WcStatus::RetryExceeded => P::RetryExceeded,
        WcStatus::RnrRetryExceeded => P::RnrRetryExceeded,
    }
}

pub(crate) fn wc_status_from(raw: i32) -> Result<WcStatus, String> {
    use proto::WcStatus as P;
    Ok(
        match P::try_from(raw).map_err(|_| format!("unknown completion status {raw}"))? {
            P::Success => WcStatus::Success,
            P::LocalLength => WcStatus::LocalLength,
            P::LocalProtection => WcStatus::LocalProtection,
            P::WrFlush => WcStatus::WrFlush,
            P::RemoteInvalidRequest => WcStatus::RemoteInvalidRequest,
            P::RemoteAccess => WcStatus::RemoteAccess,
            P::RetryExceeded => WcStatus::RetryExceeded,
            P::RnrRetryExceeded => WcStatus::RnrRetryExceeded,
        },
    )
}

fn wc_opcode(op: WcOpcode) -> proto::WcOpcode {
    use proto::WcOpcode as P;
    match op {
        WcOpcode::Send => P::Send,
        WcOpcode::Write => P::Write,
        WcOpcode::Read => P::Read,
        WcOpcode::CompareSwap => P::CompareSwap,
        WcOpcode::FetchAdd => P::FetchAdd,
        WcOpcode::Recv => P::Recv,
        WcOpcode::RecvWriteImm => P::RecvWriteImm,
    }
}

fn wc_opcode_from(raw: i32) -> Result<WcOpcode, String> {
    use proto::WcOpcode as P;
    Ok(
        match P::try_from(raw).map_err(|_| format!("unknown completion opcode {raw}"))? {
            P::Send => WcOpcode::Send,
            P::Write => WcOpcode::Write,
            P::Read => WcOpcode::Read,
            P::CompareSwap => WcOpcode::CompareSwap,
            P::FetchAdd => WcOpcode::FetchAdd,
            P::Recv => WcOpcode::Recv,
            P::RecvWriteImm => WcOpcode::RecvWriteImm,
        },
    )
}

pub(crate) fn qp_state(s: QpState) -> proto::QpState {
    match s {
        QpState::Init => proto::QpState::Init,
        QpState::Ready => proto::QpState::Ready,
        QpState::Error => proto::QpState::Error,
    }
}

pub(crate) fn qp_state_from(raw: i32) -> Result<QpState, String> {
    match proto::QpState::try_from(raw) {
        Ok(proto::QpState::Init) => Ok(QpState::Init),
        Ok(proto::QpState::Ready) => Ok(QpState::Ready),
        Ok(proto::QpState::Error) => Ok(QpState::Error),
        _ => Err(format!("unknown queue-pair state {raw}")),
    }
}

pub(crate) fn endpoint(e: QpEndpoint) -> proto::Endpoint {
    proto::Endpoint {
        node: e.node.0,
        qpn: e.qpn,
    }
}

pub(crate) fn endpoint_from(e: &proto::Endpoint) -> QpEndpoint {
    QpEndpoint {
        node: NodeId(e.node),
        qpn: e.qpn,
    }
}

fn required<'a, T>(field: &'a Option<T>, name: &str) -> Result<&'a T, String> {
    field.as_ref().ok_or_else(|| format!("`{name}` is missing"))
}

fn local_buf(b: LocalBuf) -> proto::LocalBuf {
    proto::LocalBuf {
        lkey: b.lkey,
        offset: b.offset,
        len: b.len,
    }
}

fn local_buf_from(b: &Option<proto::LocalBuf>, name: &str) -> Result<LocalBuf, String> {
    let b = required(b, name)?;
    Ok(LocalBuf {
        lkey: b.lkey,
        offset: b.offset,
        len: b.len,
    })
}

fn remote_addr(a: RemoteAddr) -> proto::RemoteAddr {
    proto::RemoteAddr {
        node: a.node.0,
        rkey: a.rkey,
        offset: a.offset,
    }
}

fn remote_addr_from(a: &Option<proto::RemoteAddr>) -> Result<RemoteAddr, String> {
    let a = required(a, "remote")?;
    Ok(RemoteAddr {
        node: NodeId(a.node),
        rkey: a.rkey,
        offset: a.offset,
    })
}

fn source(s: Src<'_>) -> proto::Source {
    use proto::source::Source as P;
    proto::Source {
        source: Some(match s {
            Src::Buf(b) => P::Buf(local_buf(b)),
            Src::Inline(d) => P::Inline(d.to_vec()),
        }),
    }
}

fn source_from(s: &Option<proto::Source>) -> Result<Src<'_>, String> {
    use proto::source::Source as P;
    match &required(s, "local")?.source {
        Some(P::Buf(b)) => Ok(Src::Buf(local_buf_from(&Some(*b), "local.buf")?)),
        Some(P::Inline(d)) => Ok(Src::Inline(d)),
        None => Err("`local` names neither a buffer nor inline data".into()),
    }
}

pub(crate) fn send_wr(wr: &SendWr<'_>) -> proto::WorkRequest {
    use proto::work_request::Op as P;
    let op = match wr.op {
        WrOp::Read { local, remote } => P::Read(proto::ReadOp {
            local: Some(local_buf(local)),
            remote: Some(remote_addr(remote)),
        }),
        WrOp::Write { local, remote, imm } => P::Write(proto::WriteOp {
            local: Some(source(local)),
            remote: Some(remote_addr(remote)),
            imm,
        }),
        WrOp::Send { local, imm } => P::Send(proto::SendOp {
            local: Some(source(local)),
            imm,
        }),
        WrOp::Cas {
            local,
            remote,
            compare,
            swap,
        } => P::Cas(proto::CasOp {
            local: Some(local_buf(local)),
            remote: Some(remote_addr(remote)),
            compare,
            swap,
        }),
        WrOp::FetchAdd { local, remote, add } => P::FetchAdd(proto::FetchAddOp {
            local: Some(local_buf(local)),
            remote: Some(remote_addr(remote)),
            add,
        }),
    };
    proto::WorkRequest {
        wr_id: wr.wr_id,
        signaled: wr.signaled,
        dest: wr.dest.map(|d| proto::UdDest {
            endpoint: Some(endpoint(d.endpoint)),
            qkey: d.qkey,
        }),
        op: Some(op),
    }
}

/// The work request `wr` describes; inline data stays in `wr`.
pub(crate) fn send_wr_from(wr: &proto::WorkRequest) -> Result<SendWr<'_>, String> {
    use proto::work_request::Op as P;
    let op = match required(&wr.op, "op")? {
        P::Read(r) => WrOp::Read {
            local: local_buf_from(&r.local, "local")?,
            remote: remote_addr_from(&r.remote)?,
        },
        P::Write(w) => WrOp::Write {
            local: source_from(&w.local)?,
            remote: remote_addr_from(&w.remote)?,
            imm: w.imm,
        },
        P::Send(s) => WrOp::Send {
            local: source_from(&s.local)?,
            imm: s.imm,
        },
        P::Cas(c) => WrOp::Cas {
            local: local_buf_from(&c.local, "local")?,
            remote: remote_addr_from(&c.remote)?,
            compare: c.compare,
            swap: c.swap,
        },
        P::FetchAdd(f) => WrOp::FetchAdd {
            local: local_buf_from(&f.local, "local")?,
            remote: remote_addr_from(&f.remote)?,
            add: f.add,
        },
    };
    let dest = match &wr.dest {
        Some(d) => Some(UdDest {
            endpoint: endpoint_from(required(&d.endpoint, "dest.endpoint")?),
            qkey: d.qkey,
        }),
        None => None,
    };
    Ok(SendWr {
        wr_id: wr.wr_id,
        op,
        signaled: wr.signaled,
        dest,
    })
}

pub(crate) fn recv_wr(wr: &RecvWr) -> proto::ReceiveRequest {
    proto::ReceiveRequest {
        wr_id: wr.wr_id,
        buf: Some(local_buf(wr.buf)),
    }
}

pub(crate) fn recv_wr_from(wr: &proto::ReceiveRequest) -> Result<RecvWr, String> {
    Ok(RecvWr {
        wr_id: wr.wr_id,
        buf: local_buf_from(&wr.buf, "buf")?,
    })
}

pub(crate) fn completion(c: &Completion) -> proto::WorkCompletion {
    proto::WorkCompletion {
        wr_id: c.wr_id,
        status: wc_status(c.status) as i32,
        opcode: wc_opcode(c.opcode) as i32,
        byte_len: c.byte_len,
        imm: c.imm,
        qpn: c.qpn,
        src: c.src.map(endpoint),
    }
}

pub(crate) fn completion_from(c: &proto::WorkCompletion) -> Result<Completion, String> {
    Ok(Completion {
        wr_id: c.wr_id,
        status: wc_status_from(c.status)?,
        opcode: wc_opcode_from(c.opcode)?,
        byte_len: c.byte_len,
        imm: c.imm,
        qpn: c.qpn,
        src: c.src.as_ref().map(endpoint_from),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: &SendWr<'_>, b: &SendWr<'_>) -> bool {
        // SendWr has no PartialEq (it borrows); its Debug form names every field.
        format!("{a:?}") == format!("{b:?}")
    }

    #[test]
    fn every_work_request_round_trips() {
        let local = LocalBuf {
            lkey: 0x101,
            offset: 24,
            len: 8,
        };
        let remote = RemoteAddr {
            node: NodeId(7),
            rkey: 0x202,
            offset: u64::MAX - 8,
        };
        let dest = UdDest {
            endpoint: QpEndpoint {
                node: NodeId(9),
                qpn: 4,
            },
            qkey: 0x1111_1111,
        };
        let wrs = [
            SendWr::read(1, local, remote),
            SendWr::write(2, Src::Inline(b"inline"), remote).unsignaled(),
            SendWr::write_imm(3, local, remote, 42),
            SendWr::send(4, local).to(dest),
            SendWr::send_imm(5, Src::Inline(&[]), 0),
            SendWr::cas(6, local, remote, 1, 2),
            SendWr::fetch_add(u64::MAX, local, remote, 3),
        ];
        for wr in &wrs {
            let wire = send_wr(wr);
            assert!(same(wr, &send_wr_from(&wire).unwrap()), "{wr:?}");
        }
        let recv = RecvWr {
            wr_id: 8,
            buf: local,
        };
        let back = recv_wr_from(&recv_wr(&recv)).unwrap();
        assert_eq!((back.wr_id, back.buf), (recv.wr_id, recv.buf));
    }

    #[test]
    fn completions_round_trip() {
        let c = Completion {
            wr_id: 3,
            status: WcStatus::RnrRetryExceeded,
            opcode: WcOpcode::RecvWriteImm,
            byte_len: 4136,
            imm: Some(0xfeed),
            qpn: 12,
            src: Some(QpEndpoint {
                node: NodeId(1),
                qpn: 2,
            }),
        };
        assert_eq!(completion_from(&completion(&c)).unwrap(), c);
        let d = Completion::default();
        assert_eq!(completion_from(&completion(&d)).unwrap(), d);
        for s in [QpState::Init, QpState::Ready, QpState::Error] {
            assert_eq!(qp_state_from(qp_state(s) as i32), Ok(s));
        }
    }

    #[test]
    fn malformed_messages_name_what_is_wrong() {
        let mut wire = send_wr(&SendWr::read(
            1,
            LocalBuf {
                lkey: 1,
                offset: 0,
                len: 8,
            },
            RemoteAddr {
                node: NodeId(1),
                rkey: 1,
                offset: 0,
            },
        ));
        if let Some(proto::work_request::Op::Read(r)) = &mut wire.op {
            r.remote = None;
        }
        assert_eq!(send_wr_from(&wire).unwrap_err(), "`remote` is missing");
        wire.op = None;
        assert_eq!(send_wr_from(&wire).unwrap_err(), "`op` is missing");
        let mut c = completion(&Completion::default());
        c.status = 99;
        assert_eq!(
            completion_from(&c).unwrap_err(),
            "unknown completion status 99"
        );
        assert!(qp_state_from(0).is_err(), "UNSPECIFIED is no state");
        assert!(
            recv_wr_from(&proto::ReceiveRequest {
                wr_id: 1,
                buf: None
            })
            .is_err()
        );
    }
}
