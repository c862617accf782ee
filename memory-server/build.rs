//! Compiles the gRPC protocol: the control plane and the remote-verbs service, one
//! package. `protoc` comes from `protoc-bin-vendored`, so the build needs no system
//! package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/namdb/memory_server/v1/control.proto",
        "proto/namdb/memory_server/v1/remote_verbs.proto",
    ];
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // What a call of a method the server does not have is told (unknown_method).
    config.file_descriptor_set_path(
        std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("descriptors.bin"),
    );
    tonic_prost_build::configure().compile_with_config(config, &protos, &["proto"])?;
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
