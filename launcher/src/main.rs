//! `kvrun`: starts a kvstore job's scheduler, servers and workers.
use clap::Parser;

fn main() {
    kvstore_launcher::child_signal_default();
    // Arguments as the OS gave them: a path that is not UTF-8 is a path all the same.
    let first = std::env::args_os().nth(1);
    if first.as_deref() == Some(std::ffi::OsStr::new(kvstore_launcher::shepherd::ARG)) {
        std::process::exit(kvstore_launcher::shepherd::run());
    }
    if first.as_deref() == Some(std::ffi::OsStr::new("doctor")) {
        let opts = kvstore_launcher::doctor::DoctorOptions::parse_from(std::env::args_os().skip(1));
        std::process::exit(kvstore_launcher::doctor::run(&opts));
    }
    let opts = kvstore_launcher::Options::parse();
    std::process::exit(kvstore_launcher::run(&opts));
}
