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

/// A stranger who keeps as many links open as a server lets wait: the next link (a worker's)
/// takes the oldest one's place, said hello or not (a hello costs a stranger nothing). Before,
/// the newest was closed, so a stranger who kept them open turned every worker away. What a
/// link given up says after that is not taken.
#[test]
fn a_new_link_takes_the_place_of_the_oldest_waiting_one() {
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
    w.peers.get_mut(&links[0]).unwrap().claim = Some((0, [0; auth::NONCE], [0; auth::NONCE]));
    let worker = connect(&mut w, &mut s, 9);
    assert_eq!(w.close, [links[0]], "the oldest gives its place");
    assert!(!w.close.contains(&worker));
    // The next goes the same way, past the one being closed.
    connect(&mut w, &mut s, 10);
    assert_eq!(w.close, [links[0], links[1]]);
    // A message of a link being closed is not taken (a hello would have been answered).
    let mut hello = Msg::new(Op::Hello);
    hello.sender = 0;
    hello.key = role::WORKER;
    let mut body = hello.encode().to_vec();
    body.extend_from_slice(&[7; auth::NONCE]);
    let before = w.peers[&links[1]].claim;
    assert_eq!(w.recv(&mut s, links[1], &body, None), Ok(()));
    assert_eq!(w.peers[&links[1]].claim, before);
    assert!(w.recv(&mut s, links[2], &body, None).is_ok());
    assert!(
        w.peers[&links[2]].claim.is_some(),
        "a live link's hello is taken"
    );
}
