use super::*;
use crate::protocol::Op;

#[test]
fn descriptors_round_trip() {
    let mut m = Msg::new(Op::PushPull);
    m.key = 7;
    m.len = 3;
    m.total = 3;
    let src = Region {
        offset: 65536,
        len: 12,
    };
    let dst = Region {
        offset: 131072,
        len: 12,
    };
    let d = encode(&m, 12, Some(src), Some(dst), b"why");
    let x = decode(&d).unwrap();
    assert_eq!(x.msg, m);
    assert_eq!(
        (x.payload_len, x.src, x.dst, x.text.as_str()),
        (12, Some(src), Some(dst), "why")
    );
    let mut bad = d;
    bad[0] ^= 0xff;
    assert!(decode(&bad).is_err());
}

#[test]
fn pool_arrays_live_in_the_pool_and_give_their_pages_back() {
    let p = WorkerPool::create(1 << 20).unwrap();
    let free = p.pool.free_pages();
    let a = p.alloc_array(&[1000], DType::F32).unwrap();
    assert!(a.is_shared_memory());
    assert!(p.offset_of(&a).is_some());
    assert_eq!(p.pool.free_pages(), free - 1);
    let copy = a.clone();
    let mut written = copy.clone();
    written.fill(1.0);
    assert!(
        !written.is_shared_memory(),
        "writing a clone copies it out of the pool"
    );
    drop(a);
    drop(copy);
    assert_eq!(p.pool.free_pages(), free);
}

#[test]
fn the_peer_is_the_process_the_kernel_names_and_another_user_is_refused() {
    use std::os::unix::process::CommandExt;
    let (a, _b) = UnixStream::pair().unwrap();
    let p = PeerProcess::of(&a).unwrap();
    assert_eq!(p.pid() as u32, std::process::id());
    assert!(!p.exited());
    if !rustix::process::geteuid().is_root() {
        println!("SKIPPED: another user needs root");
        return;
    }
    let name = format!("kvstore.test-peer.{}", std::process::id());
    let l = UnixListener::bind_addr(&UnixAddr::from_abstract_name(&name).unwrap()).unwrap();
    l.set_nonblocking(true).unwrap();
    let script = format!(
        "import socket,time\ns=socket.socket(socket.AF_UNIX)\ns.connect('\\0{name}')\ntime.sleep(10)"
    );
    let Ok(mut child) = std::process::Command::new("python3")
        .args(["-c", &script])
        .uid(65534)
        .gid(65534)
        .spawn()
    else {
        println!("SKIPPED: no python3 to connect as another user");
        return;
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let sock = loop {
        match l.accept() {
            Ok((s, _)) => break s,
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("the other user's process never connected: {e}"),
        }
    };
    let refused = PeerProcess::of(&sock);
    let _ = child.kill();
    let _ = child.wait();
    match refused {
        Err(e) => assert!(e.to_string().contains("another user"), "{e}"),
        Ok(_) => panic!("a peer of another user was accepted"),
    }
}

#[test]
fn peer_pages_are_read_by_copy_or_summed_in_place() {
    let p = WorkerPool::create(1 << 20).unwrap();
    let r = p.pool.alloc(16).unwrap();
    let vals = [1.0f32, 2.0, 3.0, 4.0];
    p.seg.write(r.offset, bytemuck::cast_slice(&vals)).unwrap();
    let pages = PeerPages {
        seg: p.seg.clone(),
        offset: r.offset,
        len: 4,
        dtype: DType::F32,
    };
    let mut acc = NDArray::from_vec(&[4], vec![10.0f32; 4]).unwrap();
    pages.add_into(&mut acc).unwrap();
    assert_eq!(acc.to_vec::<f32>().unwrap(), vec![11.0, 12.0, 13.0, 14.0]);
    assert_eq!(pages.to_array().unwrap().to_vec::<f32>().unwrap(), vals);
    assert_eq!(pages.to_bytes().unwrap(), bytemuck::cast_slice(&vals));
    assert!(pages.add_into(&mut NDArray::zeros(&[3])).is_err());
    assert!(pages
        .copy_into(&mut NDArray::zeros_dtype(&[4], DType::F64))
        .is_err());
    // A region past the mapping is refused, not read.
    let past = PeerPages {
        seg: p.seg.clone(),
        offset: p.seg.len() - 8,
        len: 4,
        dtype: DType::F32,
    };
    assert!(past.add_into(&mut NDArray::zeros(&[4])).is_err());
    assert!(past.to_array().is_err());
}

#[test]
fn host_ids_are_stable() {
    assert_eq!(host_id(), host_id());
    assert!(host_id().contains("net"));
}
