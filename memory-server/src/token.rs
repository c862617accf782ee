//! The cluster token: the shared secret every memory server and its peers hold, and the
//! file it lives in.
//!
//! The token is the file's bytes with surrounding whitespace trimmed, so an editor's
//! trailing newline does not change it. `generate_token_file` writes 32 random bytes as
//! 64 hex digits, but any secret of at least [`MIN_TOKEN_BYTES`] works.

use rand::RngCore;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The shortest token accepted. The handshake lets anyone who can reach a server test
/// token guesses offline against a proof, so the token must not be guessable.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Random bytes in a generated token (written as twice as many hex digits).
pub const GENERATED_TOKEN_BYTES: usize = 32;

#[derive(Debug, Error)]
pub enum TokenError {
    #[error(
        "token file {path} does not exist (create one with `namdb token generate {path}`)",
        path = .path.display()
    )]
    NotFound { path: PathBuf },
    #[error("cannot read token file {path}: {source}", path = .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin} is empty")]
    Empty { origin: String },
    #[error("{origin} holds a token of {len} bytes; at least {MIN_TOKEN_BYTES} are required")]
    TooShort { origin: String, len: usize },
    #[error("token file {path} already exists; refusing to overwrite it", path = .path.display())]
    Exists { path: PathBuf },
    #[error("cannot write token file {path}: {source}", path = .path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The shared secret. Its `Debug` output does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken(Vec<u8>);

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterToken(<{} bytes, redacted>)", self.0.len())
    }
}

impl ClusterToken {
    /// A token from its bytes, trimmed of surrounding whitespace.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<ClusterToken, TokenError> {
        ClusterToken::parse(bytes.as_ref(), || "the token".to_string())
    }

    fn parse(bytes: &[u8], origin: impl Fn() -> String) -> Result<ClusterToken, TokenError> {
        let token = bytes.trim_ascii();
        if token.is_empty() {
            return Err(TokenError::Empty { origin: origin() });
        }
        if token.len() < MIN_TOKEN_BYTES {
            return Err(TokenError::TooShort {
                origin: origin(),
                len: token.len(),
            });
        }
        Ok(ClusterToken(token.to_vec()))
    }

    /// Reads a token file. A file that group or others may access is accepted with a
    /// warning (logged), since refusing would break setups that share it on purpose.
    pub fn from_file(path: &Path) -> Result<ClusterToken, TokenError> {
        let bytes = std::fs::read(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => TokenError::NotFound { path: path.into() },
            _ => TokenError::Read {
                path: path.into(),
                source,
            },
        })?;
        let token = ClusterToken::parse(&bytes, || format!("token file {}", path.display()))?;
        if let Some(warning) = mode_warning(path) {
            tracing::warn!("{warning}");
        }
        Ok(token)
    }

    /// A fresh random token: [`GENERATED_TOKEN_BYTES`] random bytes as hex digits.
    pub fn generate() -> ClusterToken {
        let mut bytes = [0u8; GENERATED_TOKEN_BYTES];
        rand::rng().fill_bytes(&mut bytes);
        ClusterToken(hex::encode(bytes).into_bytes())
    }

    /// The secret itself, for a data path that runs its own handshake with it (the
    /// tcp and shm fabric backends). Never log or send it.
    pub fn secret(&self) -> &[u8] {
        &self.0
    }

    /// A key derived from the token for one purpose, named by `label`:
    /// HMAC-SHA256(token, label). It proves possession of the token without revealing
    /// it, and a key of one purpose is useless for another.
    pub fn derive(&self, label: &[u8]) -> [u8; 32] {
        use hmac::Mac;
        self.derivation(label).finalize().into_bytes().into()
    }

    /// Whether `candidate` is [`ClusterToken::derive`]`(label)`, compared in constant
    /// time.
    pub fn verify_derived(&self, label: &[u8], candidate: &[u8]) -> bool {
        use hmac::Mac;
        self.derivation(label).verify_slice(candidate).is_ok()
    }

    fn derivation(&self, label: &[u8]) -> hmac::Hmac<sha2::Sha256> {
        use hmac::Mac;
        let mut mac = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.0)
            .expect("HMAC accepts keys of any length");
        mac.update(label);
        mac
    }
}

/// Writes a fresh token to a new file, readable and writable by its owner only (0600).
/// An existing file is never overwritten: it may be the token a running cluster uses.
pub fn generate_token_file(path: &Path) -> Result<ClusterToken, TokenError> {
    let token = ClusterToken::generate();
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::AlreadyExists => TokenError::Exists { path: path.into() },
        _ => TokenError::Write {
            path: path.into(),
            source,
        },
    })?;
    let write_err = |source| TokenError::Write {
        path: path.into(),
        source,
    };
    file.write_all(&token.0).map_err(write_err)?;
    file.write_all(b"\n").map_err(write_err)?;
    file.sync_all().map_err(write_err)?;
    Ok(token)
}

/// The warning for a token file that group or others may access, if it is one.
pub fn mode_warning(path: &Path) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
        mode_warning_for(path, mode)
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

fn mode_warning_for(path: &Path, mode: u32) -> Option<String> {
    (mode & 0o077 != 0).then(|| {
        format!(
            "token file {} has mode {mode:04o}: group or others can access the cluster token; \
             `chmod 600 {}` to keep it to its owner",
            path.display(),
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &tempfile::TempDir, name: &str, content: &[u8]) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        path
    }

    #[test]
    fn generated_file_round_trips_and_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let token = generate_token_file(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.len(), 2 * GENERATED_TOKEN_BYTES + 1);
        assert!(text.trim_end().chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(ClusterToken::from_file(&path).unwrap(), token);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            assert_eq!(mode_warning(&path), None);
        }
    }

    #[test]
    fn generated_tokens_differ() {
        assert_ne!(ClusterToken::generate(), ClusterToken::generate());
    }

    #[test]
    fn generation_never_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "token", b"the cluster's existing token");
        let err = generate_token_file(&path).unwrap_err();
        assert!(matches!(err, TokenError::Exists { .. }), "{err}");
        assert!(err.to_string().contains("refusing to overwrite"), "{err}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"the cluster's existing token"
        );
    }

    #[test]
    fn missing_file_says_how_to_make_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent");
        let err = ClusterToken::from_file(&path).unwrap_err();
        assert!(matches!(err, TokenError::NotFound { .. }));
        let msg = err.to_string();
        assert!(
            msg.contains("does not exist") && msg.contains("namdb token generate"),
            "{msg}"
        );
    }

    #[test]
    fn empty_and_short_tokens_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let empty = write(&dir, "empty", b"");
        let blank = write(&dir, "blank", b"  \n\t\n");
        let short = write(&dir, "short", b"  fifteen-bytes!!\n");
        assert!(matches!(
            ClusterToken::from_file(&empty),
            Err(TokenError::Empty { .. })
        ));
        assert!(matches!(
            ClusterToken::from_file(&blank),
            Err(TokenError::Empty { .. })
        ));
        let err = ClusterToken::from_file(&short).unwrap_err();
        assert!(
            matches!(err, TokenError::TooShort { len: 15, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("at least 16"), "{err}");
    }

    #[test]
    fn surrounding_whitespace_is_not_part_of_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "t", b"\n  sixteen-bytes!!!  \r\n");
        let token = ClusterToken::from_file(&path).unwrap();
        assert_eq!(token.secret(), b"sixteen-bytes!!!");
        assert_eq!(token, ClusterToken::new(" sixteen-bytes!!!\n").unwrap());
    }

    #[test]
    fn unreadable_path_is_a_read_error() {
        let dir = tempfile::tempdir().unwrap();
        // A directory exists but cannot be read as a file.
        let err = ClusterToken::from_file(dir.path()).unwrap_err();
        assert!(matches!(err, TokenError::Read { .. }), "{err:?}");
    }

    #[test]
    fn group_or_world_access_is_warned_about() {
        let path = Path::new("/etc/namdb/token");
        assert_eq!(mode_warning_for(path, 0o600), None);
        assert_eq!(mode_warning_for(path, 0o400), None);
        for mode in [0o640, 0o604, 0o644, 0o660, 0o666] {
            let w = mode_warning_for(path, mode).expect("warned");
            assert!(
                w.contains("chmod 600") && w.contains("/etc/namdb/token"),
                "{w}"
            );
        }
    }

    #[test]
    fn derived_keys_verify_only_for_their_label_and_token() {
        let token = ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
        let other = ClusterToken::new("fedcba9876543210fedcba9876543210").unwrap();
        let key = token.derive(b"purpose a");
        assert!(token.verify_derived(b"purpose a", &key));
        assert!(!token.verify_derived(b"purpose b", &key));
        assert!(!other.verify_derived(b"purpose a", &key));
        assert!(!token.verify_derived(b"purpose a", &key[..31]));
    }

    #[test]
    fn debug_does_not_leak_the_token() {
        let token = ClusterToken::new("a-very-secret-cluster-token").unwrap();
        let shown = format!("{token:?}");
        assert!(!shown.contains("secret"), "{shown}");
    }
}
