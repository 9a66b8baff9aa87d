//! Keys, and the single-or-list arguments of `init`, `push` and `pull`, as MXNet accepts them.

use std::fmt;

use smallvec::smallvec;

use crate::{KvError, NDArray, Result};

/// A key: an integer or a string (MXNet takes both, but not in one store).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// An integer key.
    Int(i64),
    /// A string key.
    Str(String),
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Int(i) => write!(f, "{i}"),
            Key::Str(s) => f.write_str(s),
        }
    }
}

macro_rules! key_from_int {
    ($($t:ty),*) => {$(
        impl From<$t> for Key {
            fn from(k: $t) -> Key {
                Key::Int(k as i64)
            }
        }
        impl From<&$t> for Key {
            fn from(k: &$t) -> Key {
                Key::Int(*k as i64)
            }
        }
    )*};
}
key_from_int!(i32, i64, u32, u64, usize);

impl From<&str> for Key {
    fn from(k: &str) -> Key {
        Key::Str(k.to_string())
    }
}
impl From<&&str> for Key {
    fn from(k: &&str) -> Key {
        Key::Str(k.to_string())
    }
}
impl From<String> for Key {
    fn from(k: String) -> Key {
        Key::Str(k)
    }
}
impl From<&String> for Key {
    fn from(k: &String) -> Key {
        Key::Str(k.clone())
    }
}
impl From<&Key> for Key {
    fn from(k: &Key) -> Key {
        k.clone()
    }
}

/// One key, or a list of keys.
#[derive(Clone, Debug)]
pub enum Keys {
    /// A single key.
    One(Key),
    /// A list of keys.
    Many(Vec<Key>),
}

macro_rules! keys_from_one {
    ($($t:ty),*) => {$(
        impl From<$t> for Keys {
            fn from(k: $t) -> Keys {
                Keys::One(k.into())
            }
        }
    )*};
}
keys_from_one!(i32, i64, u32, u64, usize, &str, String, &String, Key, &Key);

macro_rules! keys_from_list {
    ($($t:ty),*) => {$(
        impl From<&[$t]> for Keys {
            fn from(k: &[$t]) -> Keys {
                Keys::Many(k.iter().map(Key::from).collect())
            }
        }
        impl From<&Vec<$t>> for Keys {
            fn from(k: &Vec<$t>) -> Keys {
                Keys::Many(k.iter().map(Key::from).collect())
            }
        }
        impl From<Vec<$t>> for Keys {
            fn from(k: Vec<$t>) -> Keys {
                Keys::Many(k.iter().map(Key::from).collect())
            }
        }
        impl<const N: usize> From<[$t; N]> for Keys {
            fn from(k: [$t; N]) -> Keys {
                Keys::Many(k.iter().map(Key::from).collect())
            }
        }
        impl<const N: usize> From<&[$t; N]> for Keys {
            fn from(k: &[$t; N]) -> Keys {
                Keys::Many(k.iter().map(Key::from).collect())
            }
        }
    )*};
}
keys_from_list!(i32, i64, u32, u64, usize, &str, String, Key);

/// The values of a call: one array, a list (one per key, or one per device for a single key),
/// or a list of lists (one list per key).
#[derive(Clone, Debug)]
pub enum Values<'a> {
    /// One array.
    One(&'a NDArray),
    /// A list of arrays.
    List(Vec<&'a NDArray>),
    /// A list of lists of arrays.
    Nested(Vec<Vec<&'a NDArray>>),
}

impl<'a> From<&'a NDArray> for Values<'a> {
    fn from(v: &'a NDArray) -> Self {
        Values::One(v)
    }
}
impl<'a> From<&'a [NDArray]> for Values<'a> {
    fn from(v: &'a [NDArray]) -> Self {
        Values::List(v.iter().collect())
    }
}
impl<'a> From<&'a Vec<NDArray>> for Values<'a> {
    fn from(v: &'a Vec<NDArray>) -> Self {
        Values::List(v.iter().collect())
    }
}
impl<'a, const N: usize> From<&'a [NDArray; N]> for Values<'a> {
    fn from(v: &'a [NDArray; N]) -> Self {
        Values::List(v.iter().collect())
    }
}
impl<'a> From<Vec<&'a NDArray>> for Values<'a> {
    fn from(v: Vec<&'a NDArray>) -> Self {
        Values::List(v)
    }
}
impl<'a> From<&'a [Vec<NDArray>]> for Values<'a> {
    fn from(v: &'a [Vec<NDArray>]) -> Self {
        Values::Nested(v.iter().map(|l| l.iter().collect()).collect())
    }
}
impl<'a> From<&'a Vec<Vec<NDArray>>> for Values<'a> {
    fn from(v: &'a Vec<Vec<NDArray>>) -> Self {
        Values::Nested(v.iter().map(|l| l.iter().collect()).collect())
    }
}
impl<'a> From<Vec<Vec<&'a NDArray>>> for Values<'a> {
    fn from(v: Vec<Vec<&'a NDArray>>) -> Self {
        Values::Nested(v)
    }
}

/// The outputs of a pull: one array, a list, or a list of lists (as [`Values`]).
#[derive(Debug)]
pub enum Outputs<'a> {
    /// One array.
    One(&'a mut NDArray),
    /// A list of arrays.
    List(Vec<&'a mut NDArray>),
    /// A list of lists of arrays.
    Nested(Vec<Vec<&'a mut NDArray>>),
}

impl<'a> From<&'a mut NDArray> for Outputs<'a> {
    fn from(v: &'a mut NDArray) -> Self {
        Outputs::One(v)
    }
}
impl<'a> From<&'a mut [NDArray]> for Outputs<'a> {
    fn from(v: &'a mut [NDArray]) -> Self {
        Outputs::List(v.iter_mut().collect())
    }
}
impl<'a> From<&'a mut Vec<NDArray>> for Outputs<'a> {
    fn from(v: &'a mut Vec<NDArray>) -> Self {
        Outputs::List(v.iter_mut().collect())
    }
}
impl<'a, const N: usize> From<&'a mut [NDArray; N]> for Outputs<'a> {
    fn from(v: &'a mut [NDArray; N]) -> Self {
        Outputs::List(v.iter_mut().collect())
    }
}
impl<'a> From<Vec<&'a mut NDArray>> for Outputs<'a> {
    fn from(v: Vec<&'a mut NDArray>) -> Self {
        Outputs::List(v)
    }
}
impl<'a> From<&'a mut [Vec<NDArray>]> for Outputs<'a> {
    fn from(v: &'a mut [Vec<NDArray>]) -> Self {
        Outputs::Nested(v.iter_mut().map(|l| l.iter_mut().collect()).collect())
    }
}
impl<'a> From<&'a mut Vec<Vec<NDArray>>> for Outputs<'a> {
    fn from(v: &'a mut Vec<Vec<NDArray>>) -> Self {
        Outputs::Nested(v.iter_mut().map(|l| l.iter_mut().collect()).collect())
    }
}

/// A key's values or outputs in a call: mostly one, held inline.
pub(crate) type List<T> = smallvec::SmallVec<[T; 1]>;

/// Keys paired with their lists: mostly one key, held inline (the common call of one key and
/// one array allocates nothing for its arguments).
pub(crate) type Pairs<T> = smallvec::SmallVec<[(Key, List<T>); 1]>;

/// One item, a list, or a list of lists: the three forms of values and of outputs.
enum Form<T> {
    One(T),
    List(Vec<T>),
    Nested(Vec<Vec<T>>),
}

/// Pairs keys with their lists, as MXNet does: a single key takes one item or a list (one per
/// device); a list of keys takes a list (one per key) or a list of lists.
fn pair<T>(keys: Keys, form: Form<T>) -> Result<Pairs<T>> {
    let mismatch = |keys, values| Err(KvError::LengthMismatch { keys, values });
    let pairs: Pairs<T> = match (keys, form) {
        (Keys::One(k), Form::One(v)) => smallvec![(k, smallvec![v])],
        (Keys::One(k), Form::List(vs)) => smallvec![(k, List::from_vec(vs))],
        (Keys::One(k), Form::Nested(vss)) => {
            if vss.len() != 1 {
                return mismatch(1, vss.len());
            }
            smallvec![(k, vss.into_iter().flatten().collect())]
        }
        (Keys::Many(ks), Form::One(v)) => {
            if ks.len() != 1 {
                return mismatch(ks.len(), 1);
            }
            ks.into_iter()
                .next()
                .map(|k| smallvec![(k, smallvec![v])])
                .unwrap_or_default()
        }
        (Keys::Many(ks), Form::List(vs)) => {
            if ks.len() != vs.len() {
                return mismatch(ks.len(), vs.len());
            }
            ks.into_iter()
                .zip(vs)
                .map(|(k, v)| (k, smallvec![v]))
                .collect()
        }
        (Keys::Many(ks), Form::Nested(vss)) => {
            if ks.len() != vss.len() {
                return mismatch(ks.len(), vss.len());
            }
            ks.into_iter()
                .zip(vss)
                .map(|(k, vs)| (k, List::from_vec(vs)))
                .collect()
        }
    };
    for (k, vs) in &pairs {
        if vs.is_empty() {
            return Err(KvError::EmptyValues(k.clone()));
        }
    }
    Ok(pairs)
}

/// Keys paired with their values; a key given twice has its lists joined (MXNet sums them).
/// A key's list of values is on CPUs only or on GPUs only: a mixed list is an error, as no
/// one place is where it would be summed.
fn same_kind_of_device(k: &Key, vs: &[&NDArray]) -> Result<()> {
    let gpus = vs.iter().filter(|v| !v.device().is_cpu()).count();
    if gpus == 0 || gpus == vs.len() {
        return Ok(());
    }
    let on: Vec<String> = vs.iter().map(|v| v.device().to_string()).collect();
    Err(KvError::Device(format!(
        "key {k}: a list of values on CPUs and GPUs together ({}); put them on one kind",
        on.join(", ")
    )))
}

pub(crate) fn group_values<'a>(keys: Keys, values: Values<'a>) -> Result<Pairs<&'a NDArray>> {
    // One key, one value (the common call): nothing to pair, group or check.
    let (keys, values) = match (keys, values) {
        (Keys::One(k), Values::One(v)) => return Ok(smallvec![(k, smallvec![v])]),
        other => other,
    };
    let pairs = match values {
        Values::One(v) => pair(keys, Form::One(v))?,
        Values::List(vs) => pair(keys, Form::List(vs))?,
        Values::Nested(vss) => pair(keys, Form::Nested(vss))?,
    };
    if pairs.len() == 1 {
        // One key: nothing to group.
        same_kind_of_device(&pairs[0].0, &pairs[0].1)?;
        return Ok(pairs);
    }
    let mut grouped: Pairs<&'a NDArray> = Pairs::with_capacity(pairs.len());
    // A scan for a few keys; a map (no quadratic scan) for many.
    let mut at: rustc_hash::FxHashMap<Key, usize> = Default::default();
    let many = pairs.len() > 16;
    for (k, vs) in pairs {
        let found = if many {
            at.get(&k).copied()
        } else {
            grouped.iter().position(|(g, _)| *g == k)
        };
        match found {
            Some(i) => grouped[i].1.extend(vs),
            None => {
                if many {
                    at.insert(k.clone(), grouped.len());
                }
                grouped.push((k, vs));
            }
        }
    }
    for (k, vs) in &grouped {
        same_kind_of_device(k, vs)?;
    }
    Ok(grouped)
}

/// Keys paired with their outputs.
pub(crate) fn group_outputs<'a>(keys: Keys, outs: Outputs<'a>) -> Result<Pairs<&'a mut NDArray>> {
    let (keys, outs) = match (keys, outs) {
        (Keys::One(k), Outputs::One(o)) => return Ok(smallvec![(k, smallvec![o])]),
        other => other,
    };
    match outs {
        Outputs::One(v) => pair(keys, Form::One(v)),
        Outputs::List(vs) => pair(keys, Form::List(vs)),
        Outputs::Nested(vss) => pair(keys, Form::Nested(vss)),
    }
}

/// Keys paired with owned outputs, one per key (the outputs of a call in flight).
pub(crate) fn group_owned(keys: Keys, outs: Vec<NDArray>) -> Result<Vec<(Key, NDArray)>> {
    let pairs = match keys {
        Keys::One(k) => pair(Keys::Many(vec![k]), Form::List(outs))?,
        keys => pair(keys, Form::List(outs))?,
    };
    Ok(pairs
        .into_iter()
        .filter_map(|(k, mut v)| v.pop().map(|o| (k, o)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_with_a_list_is_one_group() {
        let vs = vec![NDArray::ones(&[2]); 4];
        let g = group_values(3.into(), (&vs).into()).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].0, Key::Int(3));
        assert_eq!(g[0].1.len(), 4);
    }

    #[test]
    fn key_list_pairs_one_each_or_nested() {
        let vs = vec![NDArray::ones(&[2]); 3];
        let g = group_values([5, 7, 9].into(), (&vs).into()).unwrap();
        assert_eq!(g.len(), 3);
        assert!(g.iter().all(|(_, l)| l.len() == 1));
        let nested = vec![vec![NDArray::ones(&[2]); 4]; 3];
        let g = group_values([5, 7, 9].into(), (&nested).into()).unwrap();
        assert!(g.iter().all(|(_, l)| l.len() == 4));
    }

    #[test]
    fn lengths_must_agree_and_lists_be_non_empty() {
        let vs = vec![NDArray::ones(&[2]); 2];
        assert!(matches!(
            group_values([1, 2, 3].into(), (&vs).into()),
            Err(KvError::LengthMismatch { keys: 3, values: 2 })
        ));
        let empty: Vec<NDArray> = vec![];
        assert!(matches!(
            group_values(1.into(), (&empty).into()),
            Err(KvError::EmptyValues(Key::Int(1)))
        ));
    }

    #[test]
    fn duplicate_keys_are_joined() {
        let vs = vec![NDArray::ones(&[2]); 3];
        let g = group_values([4, 8, 4].into(), (&vs).into()).unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].1.len(), 2);
    }

    #[test]
    fn string_keys() {
        let vs = vec![NDArray::ones(&[1]); 2];
        let g = group_values(["w", "b"].into(), (&vs).into()).unwrap();
        assert_eq!(g[1].0, Key::Str("b".into()));
    }
}
