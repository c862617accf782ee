//! The TCP server both the RM and the TM run: an accept loop on its own thread and a
//! thread per connection, all stopped by [`Server::stop`] (or dropping it).

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A running server. Stopping it closes the listener and every open connection, so
/// its peers see the process as gone.
pub struct Server {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    open: Arc<Mutex<HashMap<u64, TcpStream>>>,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves `listener`, running `handle` on a new thread for each connection.
    /// `name` names the threads.
    pub fn start(
        listener: TcpListener,
        name: &'static str,
        handle: impl Fn(TcpStream) + Send + Sync + 'static,
    ) -> io::Result<Server> {
        let addr = listener.local_addr()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let open = Arc::new(Mutex::new(HashMap::new()));
        let handle = Arc::new(handle);
        let acceptor = {
            let (stopping, open) = (stopping.clone(), open.clone());
            std::thread::Builder::new()
                .name(format!("{name}-accept"))
                .spawn(move || accept_loop(listener, name, &stopping, &open, handle))?
        };
        Ok(Server {
            addr,
            stopping,
            open,
            acceptor: Some(acceptor),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and closes every connection. Connection threads end on their
    /// own as their sockets fail.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        self.stopping.store(true, Ordering::SeqCst);
        // Wakes the blocked accept, which then sees the flag.
        let _ = TcpStream::connect_timeout(&dialable(self.addr), Duration::from_secs(1));
        let _ = acceptor.join();
        // Every accepted connection was registered before the acceptor ended.
        for (_, stream) in lock(&self.open).drain() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// The address to dial to reach a listener bound to `addr` on this host.
fn dialable(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V4(a) if a.ip().is_unspecified() => {
            SocketAddr::from((Ipv4Addr::LOCALHOST, a.port()))
        }
        SocketAddr::V6(a) if a.ip().is_unspecified() => {
            SocketAddr::from((Ipv6Addr::LOCALHOST, a.port()))
        }
        other => other,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A connection thread that panicked leaves the map consistent (one insert or
    // remove), so poisoning is not a reason to stop serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop<H: Fn(TcpStream) + Send + Sync + 'static>(
    listener: TcpListener,
    name: &'static str,
    stopping: &AtomicBool,
    open: &Arc<Mutex<HashMap<u64, TcpStream>>>,
    handle: Arc<H>,
) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match stream {
            Ok(stream) => stream,
            Err(e) => {
                // Out of descriptors or a connection reset before accept: not fatal.
                tracing::warn!("{name}: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = next_id;
        next_id += 1;
        match stream.try_clone() {
            Ok(clone) => {
                lock(open).insert(id, clone);
            }
            Err(e) => {
                tracing::warn!("{name}: cannot keep a handle on a connection: {e}");
                continue;
            }
        }
        let (registry, handle) = (open.clone(), handle.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-conn"))
            .spawn(move || {
                handle(stream);
                lock(&registry).remove(&id);
            });
        if let Err(e) = spawned {
            tracing::warn!("{name}: cannot start a connection thread: {e}");
            if let Some(stream) = lock(open).remove(&id) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }
}
