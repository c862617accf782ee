//! Compiles the compute node's gRPC API. `protoc` comes from `protoc-bin-vendored`, as
//! in memory-server, so the build needs no system package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/namdb/compute/v1/compute.proto";
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // What a call of a method the server does not have is told (memory_server::unknown_method).
    config.file_descriptor_set_path(
        std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("descriptors.bin"),
    );
    tonic_prost_build::configure().compile_with_config(config, &[proto], &["proto"])?;
    println!("cargo:rerun-if-changed={proto}");
    Ok(())
}
