use super::*;
use kvstore_transport::PeerId;

fn connect(w: &mut Workers, s: &mut ServerState, peer: u32) -> Addr {
    let peer = PeerId(peer);
    w.on(s, Medium::Tcp, Completion::Connected { peer });
    Addr {
        medium: Medium::Tcp,
        peer,
    }
}

/// A stranger who keeps as many silent links open as a server lets wait: the next link (a
/// worker's) takes the oldest silent one's place. Before, the newest was closed, so a
/// stranger who kept them open turned every worker away.
#[test]
fn a_new_link_takes_the_place_of_the_oldest_silent_one() {
    let mut s = ServerState::new(1, true);
    let mut w = Workers::new("a secret of sixteen bytes", vec![[0; auth::MAC]], 1 << 20);
    let mut links = Vec::new();
    for p in 0..9 {
        links.push(connect(&mut w, &mut s, p));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        w.close.is_empty(),
        "9 links wait: 1 worker and a margin of 8"
    );
    let worker = connect(&mut w, &mut s, 9);
    assert_eq!(w.close, [links[0]], "the oldest gives its place");
    assert!(!w.close.contains(&worker));
    // One that said its hello stays before a silent one, however old.
    w.close.clear();
    w.peers.remove(&links[0]);
    w.peers.get_mut(&links[1]).unwrap().claim = Some((0, [0; auth::NONCE], [0; auth::NONCE]));
    connect(&mut w, &mut s, 10);
    assert_eq!(w.close, [links[2]]);
}
