//! What a gRPC server of ours answers a call of a method it does not have.
//!
//! tonic answers UNIMPLEMENTED with an empty message, both for an unknown method of a
//! service it serves (the generated service's own fallback) and for a service it does
//! not serve (the router's): a client written by hand or in another language (grpcio,
//! grpcurl) learns nothing about what it got wrong, whether a misspelt method, a wrong
//! package, or a server of another kind. Here the answer names the path it called, and
//! the services this server has with their methods and proto files, read from the
//! descriptors `build.rs` compiles with the stubs, so they cannot fall out of step
//! with what is served.

use prost::Message;
use std::convert::Infallible;
use std::fmt::Write;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::service::{AxumBody, Routes};

/// One service: `package.Service`, its proto file (as the repository names it), its
/// methods.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Served {
    name: String,
    file: String,
    methods: Vec<String>,
}

/// The services a server has, to explain a call of anything else.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Catalog {
    services: Vec<Served>,
}

impl Catalog {
    /// The services of a serialized `FileDescriptorSet` (`build.rs` writes it next to
    /// the stubs) whose full names are in `served`; `root` is the directory of the
    /// proto include path in the repository (e.g. `memory-server/proto`), to name the
    /// files. Descriptors that do not decode, which a build cannot produce, leave the
    /// catalog empty: answers then name only the path called.
    pub fn new(descriptors: &[u8], root: &str, served: &[&str]) -> Catalog {
        let Ok(set) = prost_types::FileDescriptorSet::decode(descriptors) else {
            return Catalog::default();
        };
        let mut services = Vec::new();
        for file in &set.file {
            let package = file.package();
            for service in &file.service {
                let name = if package.is_empty() {
                    service.name().to_string()
                } else {
                    format!("{package}.{}", service.name())
                };
                if served.contains(&name.as_str()) {
                    services.push(Served {
                        name,
                        file: format!("{root}/{}", file.name()),
                        methods: service.method.iter().map(|m| m.name().into()).collect(),
                    });
                }
            }
        }
        Catalog { services }
    }

    /// Why `path` (an HTTP/2 `:path`, `/package.Service/Method`) is no method here, or
    /// `None` if it is one.
    pub fn unknown(&self, path: &str) -> Option<Status> {
        let parts = path
            .strip_prefix('/')
            .and_then(|p| p.split_once('/'))
            .filter(|(s, m)| !s.is_empty() && !m.is_empty() && !m.contains('/'));
        let Some((service, method)) = parts else {
            return Some(Status::unimplemented(format!(
                "`{path}` is no gRPC method path (`/package.Service/Method`); {}",
                self.describe()
            )));
        };
        let Some(known) = self.services.iter().find(|s| s.name == service) else {
            return Some(Status::unimplemented(format!(
                "no service `{service}` here (called `{path}`); {}",
                self.describe()
            )));
        };
        if known.methods.iter().any(|m| m == method) {
            return None;
        }
        Some(Status::unimplemented(format!(
            "{service} has no method `{method}` (called `{path}`); its methods are {} ({})",
            known.methods.join(", "),
            known.file
        )))
    }

    /// "this server serves A (file): m1, m2; B (file): …".
    fn describe(&self) -> String {
        if self.services.is_empty() {
            return "this server cannot list its services".into();
        }
        let mut s = "this server serves ".to_string();
        for (i, known) in self.services.iter().enumerate() {
            let sep = if i == 0 { "" } else { "; " };
            let _ = write!(
                s,
                "{sep}{} ({}): {}",
                known.name,
                known.file,
                known.methods.join(", ")
            );
        }
        s
    }

    /// `routes` answering a call of a service none of them serves with [`Catalog::unknown`].
    /// (The services themselves go in [`KnownMethods`].)
    pub fn fallback(self: &Arc<Self>, routes: Routes) -> Routes {
        let catalog = self.clone();
        routes
            .into_axum_router()
            .fallback(move |request: http::Request<AxumBody>| {
                let status = catalog
                    .unknown(request.uri().path())
                    .unwrap_or_else(|| Status::internal("a served method was not routed"));
                async move { answer(status) }
            })
            .into()
    }
}

/// A gRPC answer (trailers only) of `status`.
fn answer(status: Status) -> http::Response<Body> {
    let (parts, ()) = status.into_http::<()>().into_parts();
    http::Response::from_parts(parts, Body::empty())
}

/// A gRPC service that answers a call of a method it does not have with
/// [`Catalog::unknown`] rather than tonic's empty UNIMPLEMENTED.
#[derive(Clone)]
pub struct KnownMethods<S> {
    inner: S,
    catalog: Arc<Catalog>,
}

impl<S> KnownMethods<S> {
    pub fn new(inner: S, catalog: Arc<Catalog>) -> KnownMethods<S> {
        KnownMethods { inner, catalog }
    }
}

impl<S: NamedService> NamedService for KnownMethods<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tonic::codegen::Service<http::Request<B>> for KnownMethods<S>
where
    S: tonic::codegen::Service<
            http::Request<B>,
            Response = http::Response<Body>,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match self.catalog.unknown(request.uri().path()) {
            Some(status) => Box::pin(std::future::ready(Ok(answer(status)))),
            None => Box::pin(self.inner.call(request)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto;
    use tonic::Code;

    fn catalog() -> Catalog {
        Catalog::new(
            proto::FILE_DESCRIPTOR_SET,
            "memory-server/proto",
            &[
                proto::memory_server_server::SERVICE_NAME,
                proto::remote_verbs_server::SERVICE_NAME,
            ],
        )
    }

    #[test]
    fn served_methods_pass_and_others_are_explained() {
        let c = catalog();
        assert_eq!(c.services.len(), 2, "{c:?}");
        for path in [
            "/namdb.memory_server.v1.MemoryServer/Hello",
            "/namdb.memory_server.v1.MemoryServer/BorrowRegion",
            "/namdb.memory_server.v1.RemoteVerbs/PostSend",
        ] {
            assert!(c.unknown(path).is_none(), "{path}");
        }

        let s = c
            .unknown("/namdb.memory_server.v1.MemoryServer/Helo")
            .unwrap();
        assert_eq!(s.code(), Code::Unimplemented);
        let said = s.message();
        assert!(
            said.contains("has no method `Helo`")
                && said.contains("Hello, Authenticate")
                && said.contains("memory-server/proto/namdb/memory_server/v1/control.proto"),
            "{said}"
        );

        let said = c.unknown("/namdb.compute.v1.Compute/Get").unwrap();
        let said = said.message();
        assert!(
            said.contains("no service `namdb.compute.v1.Compute`")
                && said.contains("namdb.memory_server.v1.RemoteVerbs (memory-server/proto/")
                && said.contains("PostSend"),
            "{said}"
        );

        for path in ["/", "", "/a", "/a/", "//b", "/a/b/c"] {
            let said = c.unknown(path).unwrap();
            assert!(
                said.message().contains("no gRPC method path"),
                "{path}: {}",
                said.message()
            );
        }
    }

    #[test]
    fn descriptors_that_do_not_decode_still_name_the_path() {
        let c = Catalog::new(b"\xff\xff", "x", &["a.B"]);
        let said = c.unknown("/a.B/C").unwrap();
        assert!(said.message().contains("`/a.B/C`"), "{}", said.message());
    }
}
