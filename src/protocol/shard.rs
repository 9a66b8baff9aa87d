//! Which server holds which part of a key.

/// A contiguous range of a tensor's elements, held by one server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// The server's rank.
    pub server: usize,
    /// First element.
    pub start: u64,
    /// Number of elements.
    pub len: u64,
}

/// Where the `total` elements of `key` live, as MXNet places them: a tensor smaller than `bound`
/// elements goes whole to server `(key * 9973) % S`; a larger one is cut into `S` near-equal
/// contiguous slices, slice `i` on server `i` (empty slices are left out).
pub fn placement(key: u64, total: u64, num_servers: usize, bound: usize) -> Vec<Part> {
    let s = num_servers.max(1) as u64;
    if total < bound as u64 || s == 1 {
        return vec![Part {
            server: (key.wrapping_mul(9973) % s) as usize,
            start: 0,
            len: total,
        }];
    }
    (0..s)
        .map(|i| {
            let start = (total as u128 * i as u128 / s as u128) as u64;
            let end = (total as u128 * (i + 1) as u128 / s as u128) as u64;
            Part {
                server: i as usize,
                start,
                len: end - start,
            }
        })
        .filter(|p| p.len > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_keys_go_whole_to_one_server() {
        assert_eq!(
            placement(3, 6, 2, 1_000_000),
            vec![Part {
                server: (3 * 9973) % 2,
                start: 0,
                len: 6
            }]
        );
        assert_eq!(placement(5, 6, 3, 1_000_000)[0].server, (5 * 9973) % 3);
    }

    #[test]
    fn big_keys_are_cut_into_contiguous_slices_covering_everything() {
        for s in 1..6 {
            for total in [10u64, 11, 1_000_001, 7_654_321] {
                let parts = placement(1, total, s, 10);
                let mut next = 0;
                for p in &parts {
                    assert_eq!(p.start, next);
                    next += p.len;
                }
                assert_eq!(next, total);
                if s > 1 {
                    assert_eq!(parts.len(), s);
                    let max = parts.iter().map(|p| p.len).max().unwrap();
                    let min = parts.iter().map(|p| p.len).min().unwrap();
                    assert!(max - min <= 1);
                }
            }
        }
    }

    #[test]
    fn tiny_tensor_over_many_servers_skips_empty_slices() {
        let parts = placement(0, 2, 4, 0);
        assert_eq!(parts.iter().map(|p| p.len).sum::<u64>(), 2);
        assert!(parts.iter().all(|p| p.len > 0));
    }
}
