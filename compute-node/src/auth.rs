//! Authentication of API calls: every RPC carries
//! `authorization: Bearer <hex of HMAC-SHA256(cluster token, BEARER_LABEL)>`, and the
//! server compares it in constant time ([`memory_server::ClusterToken::verify_derived`]).
//!
//! Why not the memory server's challenge-response handshake: that one yields a session
//! the server must keep and expire; an API client (a shell, a Python script) should be
//! able to call with nothing but the token. The bearer value is derived, so the token
//! itself never crosses the wire, but it is a replayable credential: like the memory
//! servers' control planes, the API is meant for a trusted network until TLS comes.

use memory_server::ClusterToken;
use std::sync::Arc;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// What the bearer value is derived for; a key derived for another purpose does not
/// authenticate here.
pub const BEARER_LABEL: &[u8] = b"namdb.compute.v1 bearer";

const SCHEME: &str = "Bearer ";

/// The `authorization` metadata value a client holding `token` sends.
pub fn bearer(token: &ClusterToken) -> AsciiMetadataValue {
    format!("{SCHEME}{}", hex::encode(token.derive(BEARER_LABEL)))
        .parse()
        .expect("hex digits are ASCII")
}

/// The server's check, run before every RPC.
#[derive(Clone)]
pub struct Authenticate {
    token: Arc<ClusterToken>,
}

impl Authenticate {
    pub fn new(token: ClusterToken) -> Authenticate {
        Authenticate {
            token: Arc::new(token),
        }
    }
}

impl Interceptor for Authenticate {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let value = req.metadata().get("authorization").ok_or_else(|| {
            Status::unauthenticated(
                "no `authorization` metadata: send `Bearer <hex of HMAC-SHA256(cluster token, \"namdb.compute.v1 bearer\")>`",
            )
        })?;
        let proof = value
            .to_str()
            .ok()
            .and_then(strip_scheme)
            .and_then(|h| hex::decode(h.trim()).ok())
            .ok_or_else(|| {
                Status::unauthenticated(
                    "malformed `authorization`: expected `Bearer <64 hex digits>`",
                )
            })?;
        if self.token.verify_derived(BEARER_LABEL, &proof) {
            Ok(req)
        } else {
            Err(Status::unauthenticated(
                "wrong credentials: the caller does not hold this cluster's token",
            ))
        }
    }
}

/// The credentials after the scheme, which HTTP compares without regard to case
/// (RFC 9110 §11.1: `bearer` and `BEARER` are `Bearer`).
fn strip_scheme(value: &str) -> Option<&str> {
    let scheme = value.get(..SCHEME.len())?;
    scheme
        .eq_ignore_ascii_case(SCHEME)
        .then(|| &value[SCHEME.len()..])
}

/// The client's side: adds the bearer value to every call.
#[derive(Clone)]
pub struct AddBearer(pub AsciiMetadataValue);

impl Interceptor for AddBearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(s: &str) -> ClusterToken {
        ClusterToken::new(s).unwrap()
    }

    fn call(check: &mut Authenticate, value: Option<&str>) -> Result<Request<()>, Status> {
        let mut req = Request::new(());
        if let Some(v) = value {
            req.metadata_mut()
                .insert("authorization", v.parse().unwrap());
        }
        check.call(req)
    }

    #[test]
    fn only_the_clusters_bearer_passes() {
        let t = token("0123456789abcdef0123456789abcdef");
        let mut check = Authenticate::new(t.clone());
        let good = bearer(&t);
        assert!(call(&mut check, Some(good.to_str().unwrap())).is_ok());
        let other = bearer(&token("another token of the right length"));
        let err = call(&mut check, Some(other.to_str().unwrap())).unwrap_err();
        assert!(err.message().contains("wrong credentials"), "{err:?}");
        let err = call(&mut check, None).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        // The scheme's case does not matter, as in HTTP.
        let hex = &good.to_str().unwrap()["Bearer ".len()..];
        for scheme in ["bearer ", "BEARER "] {
            assert!(call(&mut check, Some(&format!("{scheme}{hex}"))).is_ok());
        }
        let err = call(&mut check, Some(&format!("Basic {hex}"))).unwrap_err();
        assert!(err.message().contains("malformed"), "{err:?}");
        let err = call(&mut check, Some("Bearer zz")).unwrap_err();
        assert!(err.message().contains("malformed"), "{err:?}");
        // The token itself is not a credential: only the derived value is.
        let raw = format!("Bearer {}", hex::encode(t.secret()));
        assert!(call(&mut check, Some(&raw)).is_err());
    }
}
