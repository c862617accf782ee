//! Serving the stream connections of a device's socket (tcp's soft-NIC, shm's control
//! endpoint): a thread per connection, and the set of open connections, so that
//! shutting the device down closes every one of them.

use crate::sync;
use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A connected stream socket.
pub(crate) trait Stream: Send + Sized + 'static {
    fn duplicate(&self) -> io::Result<Self>;
    fn close(&self);
}

impl Stream for TcpStream {
    fn duplicate(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Stream for UnixStream {
    fn duplicate(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

/// The connections a device is serving.
pub(crate) struct Connections<S> {
    open: Mutex<HashMap<u64, S>>,
    next: AtomicU64,
}

impl<S: Stream> Connections<S> {
    pub(crate) fn new() -> Connections<S> {
        Connections {
            open: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        }
    }

    /// Closes every connection: their serving threads see the end and exit.
    pub(crate) fn close_all(&self) {
        for (_, s) in sync::lock(&self.open).drain() {
            s.close();
        }
    }
}

/// What serves connections: a device's shared state.
pub(crate) trait Server<S: Stream>: Send + Sync + 'static {
    fn connections(&self) -> &Connections<S>;
    fn is_shut_down(&self) -> bool;
}

/// Serves each accepted connection with `serve` on a thread of its own, until the
/// server shuts down (then the next connection, e.g. its own wake-up call, ends the
/// loop).
pub(crate) fn accept_loop<N: Server<S>, S: Stream>(
    node: Arc<N>,
    incoming: impl Iterator<Item = io::Result<S>>,
    thread_name: &str,
    serve: fn(&Arc<N>, S),
) {
    for stream in incoming {
        if node.is_shut_down() {
            return;
        }
        let Ok(stream) = stream else { continue };
        let connections = node.connections();
        let id = connections.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.duplicate() {
            sync::lock(&connections.open).insert(id, clone);
        }
        let conn_node = node.clone();
        // Out of threads: the peer sees its connection closed.
        let _ = std::thread::Builder::new()
            .name(thread_name.into())
            .spawn(move || {
                serve(&conn_node, stream);
                // Closes the socket for good: the registry's clone would keep it open.
                if let Some(s) = sync::lock(&conn_node.connections().open).remove(&id) {
                    s.close();
                }
            });
    }
}
