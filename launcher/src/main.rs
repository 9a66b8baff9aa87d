//! `kvrun`: starts a kvstore job's scheduler, servers and workers.
use clap::Parser;

fn main() {
    if std::env::args().nth(1).as_deref() == Some(kvstore_launcher::shepherd::ARG) {
        std::process::exit(kvstore_launcher::shepherd::run());
    }
    let opts = kvstore_launcher::Options::parse();
    std::process::exit(kvstore_launcher::run(&opts));
}
