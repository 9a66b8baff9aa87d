//! `kvrun`: starts a kvstore job's scheduler, servers and workers.
use clap::Parser;

fn main() {
    kvstore_launcher::child_signal_default();
    if std::env::args().nth(1).as_deref() == Some(kvstore_launcher::shepherd::ARG) {
        std::process::exit(kvstore_launcher::shepherd::run());
    }
    if std::env::args().nth(1).as_deref() == Some("doctor") {
        let opts = kvstore_launcher::doctor::DoctorOptions::parse_from(std::env::args().skip(1));
        std::process::exit(kvstore_launcher::doctor::run(&opts));
    }
    let opts = kvstore_launcher::Options::parse();
    std::process::exit(kvstore_launcher::run(&opts));
}
