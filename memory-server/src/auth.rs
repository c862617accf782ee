//! The token handshake: a mutual HMAC-SHA256 challenge-response in which the token
//! never crosses the wire.
//!
//! ```text
//! client                                   server
//!   Hello(client_nonce) ───────────────────▶ picks server_nonce, challenge_id
//!   ◀─ challenge_id, server_nonce, server_proof = HMAC(token, SERVER ‖ cn ‖ sn)
//! checks server_proof (else stops: the server does not hold the token)
//!   Authenticate(challenge_id, client_proof = HMAC(token, CLIENT ‖ cn ‖ sn)) ──▶
//!                                          checks it once, issues a session
//! ```
//!
//! Distinct labels keep a server proof from being reflected back as a client proof.
//! Each challenge allows one Authenticate attempt (success or not) and expires, so a
//! recorded proof cannot be replayed and proofs cannot be guessed online. Pending
//! challenges are bounded, so unauthenticated Hellos cannot exhaust memory.

use crate::token::ClusterToken;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
pub const CHALLENGE_ID_LEN: usize = 16;

const SERVER_LABEL: &[u8] = b"namdb.memory_server.v1 server proof";
const CLIENT_LABEL: &[u8] = b"namdb.memory_server.v1 client proof";

type HmacSha256 = Hmac<Sha256>;

fn mac(token: &ClusterToken, label: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length, so this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(token.secret())
        .expect("HMAC accepts keys of any length");
    mac.update(label);
    mac.update(&[0]);
    mac.update(client_nonce);
    mac.update(server_nonce);
    mac
}

fn proof(token: &ClusterToken, label: &[u8], cn: &[u8], sn: &[u8]) -> [u8; PROOF_LEN] {
    mac(token, label, cn, sn).finalize().into_bytes().into()
}

/// Constant-time check of a proof.
fn verify(token: &ClusterToken, label: &[u8], cn: &[u8], sn: &[u8], proof: &[u8]) -> bool {
    mac(token, label, cn, sn).verify_slice(proof).is_ok()
}

fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    rand::rng().fill_bytes(&mut b);
    b
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AuthError {
    #[error("the client nonce must be {NONCE_LEN} bytes")]
    BadNonce,
    #[error(
        "unknown, expired or already used challenge: each Hello allows one Authenticate, within a few seconds"
    )]
    UnknownChallenge,
    #[error("wrong proof: the client does not hold this cluster's token")]
    BadProof,
    #[error("too many handshakes in progress; retry shortly")]
    Busy,
}

/// What Hello answers.
#[derive(Debug, Clone)]
pub(crate) struct Challenge {
    pub id: [u8; CHALLENGE_ID_LEN],
    pub server_nonce: [u8; NONCE_LEN],
    pub server_proof: [u8; PROOF_LEN],
}

struct Pending {
    client_nonce: [u8; NONCE_LEN],
    server_nonce: [u8; NONCE_LEN],
    expires: Instant,
}

/// The server side: issues challenges and checks proofs against them.
pub(crate) struct Authenticator {
    token: ClusterToken,
    pending: Mutex<HashMap<[u8; CHALLENGE_ID_LEN], Pending>>,
    ttl: Duration,
    max_pending: usize,
}

impl Authenticator {
    pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
    pub const DEFAULT_MAX_PENDING: usize = 4096;

    pub fn new(token: ClusterToken, ttl: Duration, max_pending: usize) -> Authenticator {
        Authenticator {
            token,
            pending: Mutex::new(HashMap::new()),
            ttl,
            max_pending,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; CHALLENGE_ID_LEN], Pending>> {
        // The map is consistent after every statement, so a poisoned lock is usable.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn hello(&self, client_nonce: &[u8], now: Instant) -> Result<Challenge, AuthError> {
        let client_nonce: [u8; NONCE_LEN] =
            client_nonce.try_into().map_err(|_| AuthError::BadNonce)?;
        let mut pending = self.lock();
        if pending.len() >= self.max_pending {
            pending.retain(|_, p| p.expires > now);
            if pending.len() >= self.max_pending {
                return Err(AuthError::Busy);
            }
        }
        let server_nonce = random::<NONCE_LEN>();
        let id = random::<CHALLENGE_ID_LEN>();
        pending.insert(
            id,
            Pending {
                client_nonce,
                server_nonce,
                expires: now + self.ttl,
            },
        );
        Ok(Challenge {
            id,
            server_nonce,
            server_proof: proof(&self.token, SERVER_LABEL, &client_nonce, &server_nonce),
        })
    }

    /// Checks a client's proof. The challenge is used up whatever the outcome.
    pub fn authenticate(
        &self,
        challenge_id: &[u8],
        client_proof: &[u8],
        now: Instant,
    ) -> Result<(), AuthError> {
        let id: [u8; CHALLENGE_ID_LEN] = challenge_id
            .try_into()
            .map_err(|_| AuthError::UnknownChallenge)?;
        let pending = self.lock().remove(&id).ok_or(AuthError::UnknownChallenge)?;
        if pending.expires <= now {
            return Err(AuthError::UnknownChallenge);
        }
        if verify(
            &self.token,
            CLIENT_LABEL,
            &pending.client_nonce,
            &pending.server_nonce,
            client_proof,
        ) {
            Ok(())
        } else {
            Err(AuthError::BadProof)
        }
    }

    /// Forgets expired challenges.
    pub fn purge(&self, now: Instant) {
        self.lock().retain(|_, p| p.expires > now);
    }

    #[cfg(test)]
    fn pending(&self) -> usize {
        self.lock().len()
    }
}

/// The client side of one handshake.
pub(crate) struct ClientHandshake {
    client_nonce: [u8; NONCE_LEN],
}

impl ClientHandshake {
    pub fn new() -> ClientHandshake {
        ClientHandshake {
            client_nonce: random(),
        }
    }

    pub fn client_nonce(&self) -> &[u8; NONCE_LEN] {
        &self.client_nonce
    }

    /// Checks the server's proof and, only if it holds, returns the client's proof.
    pub fn respond(
        &self,
        token: &ClusterToken,
        server_nonce: &[u8],
        server_proof: &[u8],
    ) -> Option<[u8; PROOF_LEN]> {
        if server_nonce.len() != NONCE_LEN {
            return None;
        }
        verify(
            token,
            SERVER_LABEL,
            &self.client_nonce,
            server_nonce,
            server_proof,
        )
        .then(|| proof(token, CLIENT_LABEL, &self.client_nonce, server_nonce))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(s: &str) -> ClusterToken {
        ClusterToken::new(s).unwrap()
    }

    fn server() -> Authenticator {
        Authenticator::new(
            token("the-right-cluster-token"),
            Authenticator::DEFAULT_TTL,
            16,
        )
    }

    #[test]
    fn right_token_is_accepted_both_ways() {
        let auth = server();
        let now = Instant::now();
        let client = ClientHandshake::new();
        let c = auth.hello(client.client_nonce(), now).unwrap();
        let proof = client
            .respond(
                &token("the-right-cluster-token"),
                &c.server_nonce,
                &c.server_proof,
            )
            .expect("the server holds the token");
        auth.authenticate(&c.id, &proof, now).unwrap();
        assert_eq!(auth.pending(), 0);
    }

    #[test]
    fn wrong_token_is_rejected_by_both_sides() {
        let auth = server();
        let now = Instant::now();
        let client = ClientHandshake::new();
        let c = auth.hello(client.client_nonce(), now).unwrap();
        let wrong = token("a-wrong-cluster-token");
        // The client notices first: the server's proof does not match its token.
        assert!(
            client
                .respond(&wrong, &c.server_nonce, &c.server_proof)
                .is_none()
        );
        // A client that went on anyway is refused.
        let forged = proof(&wrong, CLIENT_LABEL, client.client_nonce(), &c.server_nonce);
        assert_eq!(
            auth.authenticate(&c.id, &forged, now),
            Err(AuthError::BadProof)
        );
    }

    #[test]
    fn a_proof_cannot_be_replayed() {
        let auth = server();
        let now = Instant::now();
        let client = ClientHandshake::new();
        let c = auth.hello(client.client_nonce(), now).unwrap();
        let proof = client
            .respond(
                &token("the-right-cluster-token"),
                &c.server_nonce,
                &c.server_proof,
            )
            .unwrap();
        auth.authenticate(&c.id, &proof, now).unwrap();
        assert_eq!(
            auth.authenticate(&c.id, &proof, now),
            Err(AuthError::UnknownChallenge)
        );
    }

    #[test]
    fn a_proof_is_bound_to_its_challenge() {
        let auth = server();
        let now = Instant::now();
        let client = ClientHandshake::new();
        let first = auth.hello(client.client_nonce(), now).unwrap();
        let second = auth.hello(client.client_nonce(), now).unwrap();
        assert_ne!(first.server_nonce, second.server_nonce);
        let proof_for_first = client
            .respond(
                &token("the-right-cluster-token"),
                &first.server_nonce,
                &first.server_proof,
            )
            .unwrap();
        assert_eq!(
            auth.authenticate(&second.id, &proof_for_first, now),
            Err(AuthError::BadProof)
        );
    }

    #[test]
    fn a_failed_attempt_uses_the_challenge_up() {
        let auth = server();
        let now = Instant::now();
        let client = ClientHandshake::new();
        let c = auth.hello(client.client_nonce(), now).unwrap();
        assert_eq!(
            auth.authenticate(&c.id, &[0u8; PROOF_LEN], now),
            Err(AuthError::BadProof)
        );
        let proof = client
            .respond(
                &token("the-right-cluster-token"),
                &c.server_nonce,
                &c.server_proof,
            )
            .unwrap();
        assert_eq!(
            auth.authenticate(&c.id, &proof, now),
            Err(AuthError::UnknownChallenge)
        );
    }

    #[test]
    fn the_server_proof_is_not_a_client_proof() {
        // Reflection: send the server's own proof back as the client's.
        let auth = server();
        let now = Instant::now();
        let client = ClientHandshake::new();
        let c = auth.hello(client.client_nonce(), now).unwrap();
        assert_eq!(
            auth.authenticate(&c.id, &c.server_proof, now),
            Err(AuthError::BadProof)
        );
    }

    #[test]
    fn malformed_inputs_are_rejected() {
        let auth = server();
        let now = Instant::now();
        assert_eq!(auth.hello(&[1; 31], now).unwrap_err(), AuthError::BadNonce);
        assert_eq!(auth.hello(&[], now).unwrap_err(), AuthError::BadNonce);
        let client = ClientHandshake::new();
        let c = auth.hello(client.client_nonce(), now).unwrap();
        assert_eq!(
            auth.authenticate(&c.id[..15], &[0; PROOF_LEN], now),
            Err(AuthError::UnknownChallenge)
        );
        assert_eq!(
            auth.authenticate(&[7; CHALLENGE_ID_LEN], &[0; PROOF_LEN], now),
            Err(AuthError::UnknownChallenge)
        );
        let proof = client
            .respond(
                &token("the-right-cluster-token"),
                &c.server_nonce,
                &c.server_proof,
            )
            .unwrap();
        // A truncated proof fails even though its prefix is right.
        assert_eq!(
            auth.authenticate(&c.id, &proof[..16], now),
            Err(AuthError::BadProof)
        );
        assert!(
            client
                .respond(
                    &token("the-right-cluster-token"),
                    &c.server_nonce[..8],
                    &c.server_proof
                )
                .is_none()
        );
    }

    #[test]
    fn challenges_expire() {
        let auth = server();
        let now = Instant::now();
        let client = ClientHandshake::new();
        let c = auth.hello(client.client_nonce(), now).unwrap();
        let proof = client
            .respond(
                &token("the-right-cluster-token"),
                &c.server_nonce,
                &c.server_proof,
            )
            .unwrap();
        let later = now + Authenticator::DEFAULT_TTL;
        assert_eq!(
            auth.authenticate(&c.id, &proof, later),
            Err(AuthError::UnknownChallenge)
        );
    }

    #[test]
    fn pending_challenges_are_bounded_and_purged() {
        let auth = server();
        let now = Instant::now();
        for _ in 0..16 {
            auth.hello(&[0; NONCE_LEN], now).unwrap();
        }
        assert_eq!(
            auth.hello(&[0; NONCE_LEN], now).unwrap_err(),
            AuthError::Busy
        );
        // Once they expire, room is made again, by Hello itself or by a purge.
        let later = now + Authenticator::DEFAULT_TTL;
        auth.hello(&[0; NONCE_LEN], later).unwrap();
        assert_eq!(auth.pending(), 1);
        auth.purge(later + Authenticator::DEFAULT_TTL);
        assert_eq!(auth.pending(), 0);
    }
}
