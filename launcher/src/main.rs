//! `kvrun`: starts a kvstore job's scheduler, servers and workers.
use clap::Parser;

fn main() {
    let opts = kvstore_launcher::Options::parse();
    std::process::exit(kvstore_launcher::run(&opts));
}
