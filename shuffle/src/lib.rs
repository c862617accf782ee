//! `shuffle`: RDMA-aware data shuffling between compute nodes.
//!
//! Follows Liu, Yin and Blanas, "Design and Evaluation of an RDMA-aware Data Shuffling
//! Operator for Parallel Database Systems" (TODS 2019): the endpoint API and its eight
//! designs ([`endpoint`]), the registered buffer pool with the adaptive and
//! bandwidth-delay policies ([`pool`]), and on top of them the flows of DFI
//! (Thostrup's thesis).
//!
//! Endpoints run over any `fabric` backend. Nodes find each other through an
//! [`Exchange`]: threads of one process ([`LocalExchange`], the sim backend) or
//! processes over loopback TCP ([`TcpExchange`]).

pub mod buffer;
mod credit;
pub mod endpoint;
pub mod error;
pub mod exchange;
pub mod flow;
pub mod idle;
pub mod node;
pub mod operator;
pub mod ops;
pub mod pool;
pub mod progress;
mod rd;
#[cfg(not(shuffle_loom))]
mod ring;
/// The ring protocol, public only for the loom model (`tests/loom_ring.rs`).
#[cfg(shuffle_loom)]
#[doc(hidden)]
pub mod ring;
pub mod scatter;
mod sr;
pub mod testing;
mod ud;
mod wr;

pub use buffer::{Buffer, Header, Received, SendBuf, State};
pub use endpoint::{
    Design, EndpointConfig, Endpoints, Lane, Notify, Opened, RecvEndpoint, SendEndpoint, Transport,
    open,
};
pub use error::{Result, ShuffleError};
pub use exchange::{Exchange, LocalExchange, TcpExchange};
pub use node::Node;
pub use operator::{Groups, OwnPartition, Shuffle, ShuffleWriter, receive_all, send_and_receive};
pub use pool::{BufferPool, Buffering, Circulation};
pub use progress::{Phase, Progress};
