//! The size of the API's messages, and what a client is told when the codec refuses
//! one. gRPC libraries refuse a received message over 4 MiB unless told otherwise
//! (tonic, grpcio, grpc-java, grpc-go alike), so the node keeps to that limit both ways:
//! any client reads its answers with default settings, and a request over it, which no
//! legal request is (a value is at most its table's value cap, far below it), gets an
//! answer that says what to do instead of the codec's "decoded message length too
//! large". A request that does not decode is the client's mistake: INVALID_ARGUMENT, not
//! the codec's INTERNAL.

use crate::proto;
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::{Code, Status};

/// The largest message the node receives or sends, and the Rust client receives.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Rows per Scan message at most: large enough that framing costs little.
pub const SCAN_BATCH_ROWS: usize = 256;
/// Bytes of rows per Scan message at most (one row of a larger value goes alone): a
/// quarter of [`MAX_MESSAGE_BYTES`], whatever the table's value cap.
pub const SCAN_BATCH_BYTES: usize = MAX_MESSAGE_BYTES / 4;

/// Bytes a value of a BatchGet answer costs beyond its own: its `GetResponse`'s tag
/// and length, the `found` flag, the value's tag and length (each length a varint of
/// at most 5 bytes).
const GET_OVERHEAD: usize = 1 + 5 + 2 + 1 + 5;

/// The most keys a BatchGet of a table whose values are at most `value_cap` bytes may
/// ask for: its answer must fit one message.
pub fn batch_get_keys(value_cap: u32) -> usize {
    MAX_MESSAGE_BYTES / (value_cap as usize + GET_OVERHEAD)
}

/// Bytes `row` adds to a `ScanResponse`: the row's tag and length, its key's tag and
/// varint, its value's tag, length and bytes.
fn row_bytes(value: &[u8]) -> usize {
    1 + 5 + 1 + 10 + 1 + 5 + value.len()
}

/// `rows` as Scan messages in key order: at most [`SCAN_BATCH_ROWS`] rows and
/// [`SCAN_BATCH_BYTES`] bytes each (a single larger row goes alone).
pub fn scan_batches(rows: Vec<(u64, Vec<u8>)>) -> Vec<proto::ScanResponse> {
    let mut batches = Vec::new();
    let mut batch: Vec<proto::Row> = Vec::new();
    let mut bytes = 0;
    for (key, value) in rows {
        let size = row_bytes(&value);
        if !batch.is_empty() && (batch.len() == SCAN_BATCH_ROWS || bytes + size > SCAN_BATCH_BYTES)
        {
            batches.push(proto::ScanResponse {
                rows: std::mem::take(&mut batch),
            });
            bytes = 0;
        }
        bytes += size;
        batch.push(proto::Row { key, value });
    }
    if !batch.is_empty() {
        batches.push(proto::ScanResponse { rows: batch });
    }
    batches
}

/// What a client is told when its request is larger than [`MAX_MESSAGE_BYTES`]. The
/// request never reached the service, so a transaction it names is as it was.
pub fn too_large(found: Option<u64>) -> Status {
    let size = found.map_or("larger".to_string(), |n| format!("{n} bytes"));
    Status::invalid_argument(format!(
        "the request is {size}, over the compute node's limit of {MAX_MESSAGE_BYTES} bytes \
         (4 MiB) per message, and was not run; the transaction is still open: a value is at \
         most its table's value cap (ListTables shows value_cap), and a BatchGet asks for at \
         most 4 MiB / (value cap + {GET_OVERHEAD}) keys"
    ))
}

/// What a client is told when its request does not decode (`why`: prost's words, which
/// name the field): a client's mistake, not the node's, which INTERNAL would suggest.
pub fn undecodable(why: &str) -> Status {
    Status::invalid_argument(format!(
        "the request is not a valid namdb.compute.v1 message ({why}) and was not run; the \
         transaction is still open: send messages built from compute.proto (strings UTF-8, \
         each field of its declared type)"
    ))
}

/// Replaces the codec's answers to a request it refused, in the trailers-only headers
/// of `response`: over the decoding limit (OUT_OF_RANGE, "Error, decoded message length
/// too large: found N bytes, …") by [`too_large`], and not decodable (INTERNAL, "failed
/// to decode Protobuf message: …") by [`undecodable`]. The service itself never answers
/// OUT_OF_RANGE, nor INTERNAL in those words.
fn explain(response: &mut http::Response<Body>) {
    const UNDECODABLE: &str = "failed to decode Protobuf message: ";
    let Some(status) = Status::from_header_map(response.headers()) else {
        return;
    };
    let message = status.message();
    let clear = match status.code() {
        Code::OutOfRange if message.contains("decoded message length too large") => {
            let found = message
                .split("found ")
                .nth(1)
                .and_then(|rest| rest.split(' ').next())
                .and_then(|n| n.parse().ok());
            too_large(found)
        }
        Code::Internal if message.starts_with(UNDECODABLE) => {
            undecodable(&message[UNDECODABLE.len()..])
        }
        _ => return,
    };
    // Headers made from a status's own words always encode.
    let _ = clear.add_header(response.headers_mut());
}

/// A gRPC service whose answers to requests the codec refused say what to do (see
/// [`explain`]).
#[derive(Clone)]
pub struct ExplainCodec<S>(pub S);

impl<S: NamedService> NamedService for ExplainCodec<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tonic::codegen::Service<http::Request<B>> for ExplainCodec<S>
where
    S: tonic::codegen::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<http::Response<Body>, S::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let answer = self.0.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            explain(&mut response);
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn the_largest_batch_get_answer_fits_a_message() {
        for cap in [0u32, 1, 256, 16_360, 65_536, 1 << 20] {
            let keys = batch_get_keys(cap);
            assert!(keys >= 1, "cap {cap}");
            let answer = proto::BatchGetResponse {
                values: (0..keys)
                    .map(|_| proto::GetResponse {
                        found: true,
                        value: vec![7; cap as usize],
                    })
                    .collect(),
            };
            assert!(answer.encoded_len() <= MAX_MESSAGE_BYTES, "cap {cap}");
        }
    }

    #[test]
    fn scan_batches_keep_order_and_stay_under_their_bounds() {
        let sizes = [0usize, 10, 40_000, 300_000, 2_000_000, 5, 70_000];
        let rows: Vec<(u64, Vec<u8>)> = (0..2_000u64)
            .map(|k| {
                (
                    u64::MAX - 1 - 2_000 + k,
                    vec![1; sizes[k as usize % sizes.len()]],
                )
            })
            .collect();
        let batches = scan_batches(rows.clone());
        assert!(batches.len() > 1);
        for b in &batches {
            assert!(b.rows.len() <= SCAN_BATCH_ROWS);
            assert!(
                b.rows.len() == 1 || b.encoded_len() <= SCAN_BATCH_BYTES,
                "{} rows, {} bytes",
                b.rows.len(),
                b.encoded_len()
            );
        }
        let back: Vec<(u64, Vec<u8>)> = batches
            .into_iter()
            .flat_map(|b| b.rows)
            .map(|r| (r.key, r.value))
            .collect();
        assert_eq!(back, rows);
        let small: Vec<(u64, Vec<u8>)> = (0..600).map(|k| (k, vec![0; 8])).collect();
        let counts: Vec<usize> = scan_batches(small).iter().map(|b| b.rows.len()).collect();
        assert_eq!(counts, [256, 256, 88]);
        assert!(scan_batches(Vec::new()).is_empty());
    }

    #[test]
    fn the_codec_refusal_becomes_a_clear_invalid_argument() {
        let mut response: http::Response<Body> = Status::out_of_range(
            "Error, decoded message length too large: found 5000019 bytes, the limit is: 4194304 bytes",
        )
        .into_http();
        explain(&mut response);
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status.message().contains("5000019 bytes"),
            "{}",
            status.message()
        );
        assert!(status.message().contains("4194304"), "{}", status.message());
        assert!(
            status.message().contains("still open"),
            "{}",
            status.message()
        );
        let mut response: http::Response<Body> = Status::internal(
            "failed to decode Protobuf message: GetRequest.table: invalid string value: data is not UTF-8 encoded",
        )
        .into_http();
        explain(&mut response);
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status
                .message()
                .contains("(GetRequest.table: invalid string value")
                && status.message().contains("compute.proto"),
            "{}",
            status.message()
        );
        // Another status passes unchanged, an INTERNAL of the service's too.
        let mut other: http::Response<Body> =
            Status::internal("a block does not decode").into_http();
        explain(&mut other);
        let status = Status::from_header_map(other.headers()).unwrap();
        assert_eq!(status.code(), Code::Internal);
        let mut other: http::Response<Body> = Status::not_found("no table").into_http();
        explain(&mut other);
        let status = Status::from_header_map(other.headers()).unwrap();
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(status.message(), "no table");
    }
}
