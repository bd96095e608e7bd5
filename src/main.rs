//! The `nrun` binary: everything lives in the library (see `lib.rs` for the map).
fn main() -> std::process::ExitCode {
    nrun::main()
}
