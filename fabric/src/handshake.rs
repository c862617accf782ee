//! Mutual authentication of two devices with the cluster token, shared by the backends
//! whose peers talk over a byte stream (tcp over TCP, shm over a Unix socket).
//!
//! Challenge-response: each side proves knowledge of the token with an HMAC-SHA256 of
//! both nonces under its role, so the token itself never crosses the wire and a proof
//! cannot be replayed. The requester's proof carries its first request (a fixed-size
//! message of the protocol), so the responder acts on nothing an unauthenticated peer
//! sent. Every read is of a fixed size and bounded, so a stranger cannot make either
//! side allocate or wait on its say-so beyond the stream's timeout.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};

pub(crate) const NONCE: usize = 16;
pub(crate) const PROOF: usize = 32;

/// The byte a responder answers a failed proof with, before closing the stream.
pub(crate) const UNAUTHENTICATED: u8 = 1;

/// What distinguishes one protocol's handshake from another's: a peer of another
/// protocol (or version) fails at the hello, not deep inside a request.
pub(crate) struct Protocol {
    pub(crate) magic: &'static [u8; 8],
    pub(crate) version: u16,
    pub(crate) server_role: &'static [u8],
    pub(crate) client_role: &'static [u8],
}

type HmacSha256 = Hmac<Sha256>;

fn mac(token: &[u8], role: &[u8], client: &[u8; NONCE], server: &[u8; NONCE]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(token).expect("HMAC takes any key length");
    mac.update(role);
    mac.update(client);
    mac.update(server);
    mac
}

fn proof(token: &[u8], role: &[u8], client: &[u8; NONCE], server: &[u8; NONCE]) -> [u8; PROOF] {
    mac(token, role, client, server)
        .finalize()
        .into_bytes()
        .into()
}

fn verify(
    token: &[u8],
    role: &[u8],
    client: &[u8; NONCE],
    server: &[u8; NONCE],
    claimed: &[u8],
) -> bool {
    mac(token, role, client, server)
        .verify_slice(claimed)
        .is_ok()
}

/// The requester's side: authenticates the responder, proves itself and sends
/// `request`. Returns the responder's node id. The responder's answer to `request`
/// is the protocol's business.
pub(crate) fn client(
    stream: &mut (impl Read + Write),
    token: &[u8],
    protocol: &Protocol,
    request: &[u8],
) -> Result<u32, String> {
    let client_nonce: [u8; NONCE] = rand::random();
    let mut hello = Vec::with_capacity(8 + 2 + NONCE);
    hello.extend_from_slice(protocol.magic);
    hello.extend_from_slice(&protocol.version.to_le_bytes());
    hello.extend_from_slice(&client_nonce);
    stream
        .write_all(&hello)
        .map_err(|e| format!("handshake: {e}"))?;
    let mut challenge = [0u8; 2 + 4 + NONCE + PROOF];
    stream
        .read_exact(&mut challenge)
        .map_err(|e| format!("handshake: no challenge from the peer ({e})"))?;
    let version = u16::from_le_bytes([challenge[0], challenge[1]]);
    if version != protocol.version {
        return Err(format!(
            "peer speaks protocol version {version}, we speak {}",
            protocol.version
        ));
    }
    let node = u32::from_le_bytes(challenge[2..6].try_into().expect("4 bytes"));
    let server_nonce: [u8; NONCE] = challenge[6..6 + NONCE].try_into().expect("nonce");
    if !verify(
        token,
        protocol.server_role,
        &client_nonce,
        &server_nonce,
        &challenge[6 + NONCE..],
    ) {
        return Err("the peer does not know the cluster token".into());
    }
    let mut msg = Vec::with_capacity(PROOF + request.len());
    msg.extend_from_slice(&proof(
        token,
        protocol.client_role,
        &client_nonce,
        &server_nonce,
    ));
    msg.extend_from_slice(request);
    stream
        .write_all(&msg)
        .map_err(|e| format!("handshake: {e}"))?;
    Ok(node)
}

/// The responder's side: returns the first request (`N` bytes) of an authenticated
/// requester, or why the stream must be closed.
pub(crate) fn server<const N: usize>(
    stream: &mut (impl Read + Write),
    token: &[u8],
    protocol: &Protocol,
    node: u32,
) -> Result<[u8; N], String> {
    let mut hello = [0u8; 8 + 2 + NONCE];
    stream
        .read_exact(&mut hello)
        .map_err(|e| format!("no hello ({e})"))?;
    if &hello[..8] != protocol.magic {
        return Err("not a peer of this protocol (bad magic)".into());
    }
    let client_nonce: [u8; NONCE] = hello[10..].try_into().expect("nonce");
    let server_nonce: [u8; NONCE] = rand::random();
    let mut challenge = Vec::with_capacity(2 + 4 + NONCE + PROOF);
    challenge.extend_from_slice(&protocol.version.to_le_bytes());
    challenge.extend_from_slice(&node.to_le_bytes());
    challenge.extend_from_slice(&server_nonce);
    challenge.extend_from_slice(&proof(
        token,
        protocol.server_role,
        &client_nonce,
        &server_nonce,
    ));
    stream
        .write_all(&challenge)
        .map_err(|e| format!("handshake: {e}"))?;
    let mut msg = vec![0u8; PROOF + N];
    stream
        .read_exact(&mut msg)
        .map_err(|e| format!("no request after the proof ({e})"))?;
    if !verify(
        token,
        protocol.client_role,
        &client_nonce,
        &server_nonce,
        &msg[..PROOF],
    ) {
        let _ = stream.write_all(&[UNAUTHENTICATED]);
        return Err("requester failed authentication".into());
    }
    Ok(msg[PROOF..].try_into().expect("N bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    const P: Protocol = Protocol {
        magic: b"NAMDBTST",
        version: 3,
        server_role: b"test responder",
        client_role: b"test requester",
    };

    #[test]
    fn authenticates_both_ways_and_carries_the_request() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || server::<4>(&mut b, b"a cluster token", &P, 77));
        assert_eq!(client(&mut a, b"a cluster token", &P, b"ping"), Ok(77));
        assert_eq!(server.join().unwrap(), Ok(*b"ping"));
    }

    #[test]
    fn a_wrong_token_fails_on_both_sides() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || server::<4>(&mut b, b"the real token", &P, 1));
        let err = client(&mut a, b"a wrong token!", &P, b"ping").unwrap_err();
        assert!(err.contains("token"), "{err}");
        drop(a);
        assert!(server.join().unwrap().is_err());
    }

    #[test]
    fn another_protocol_is_refused_at_the_hello() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || server::<4>(&mut b, b"token", &P, 1));
        let other = Protocol {
            magic: b"NAMDBOTH",
            ..P
        };
        assert!(client(&mut a, b"token", &other, b"ping").is_err());
        assert!(server.join().unwrap().unwrap_err().contains("magic"));
    }
}
