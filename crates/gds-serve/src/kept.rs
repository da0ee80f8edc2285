//! What the Responses and Conversations APIs keep in memory: entries by id under a count and
//! a byte budget (each entry's cost as its owner counts it), the one used longest ago dropped
//! first, never one its owner pins (a background response still running, the conversation
//! being added to).

use std::collections::{HashMap, VecDeque};

/// Entries by id, the one used last at the back of `order`.
pub(crate) struct Kept<V> {
    map: HashMap<String, (V, usize)>,
    order: VecDeque<String>,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
}

impl<V> Kept<V> {
    pub(crate) fn new(max_entries: usize, max_bytes: usize) -> Kept<V> {
        Kept {
            map: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            max_entries,
            max_bytes,
        }
    }

    /// Keeps `value`, costing `bytes`, as used last (replacing an entry of that id), after
    /// dropping the entries used longest ago that `pinned` does not hold until it fits;
    /// false, and nothing kept, where it alone passes the byte budget.
    pub(crate) fn insert(
        &mut self,
        id: String,
        value: V,
        bytes: usize,
        pinned: impl Fn(&str, &V) -> bool,
    ) -> bool {
        if bytes > self.max_bytes {
            return false;
        }
        self.remove(&id);
        self.make_room(1, bytes, pinned);
        self.bytes += bytes;
        self.order.push_back(id.clone());
        self.map.insert(id, (value, bytes));
        true
    }

    /// Drops the entries used longest ago that `pinned` does not hold until `entries` more
    /// entries and `bytes` more bytes fit (or only pinned ones are left).
    pub(crate) fn make_room(
        &mut self,
        entries: usize,
        bytes: usize,
        pinned: impl Fn(&str, &V) -> bool,
    ) {
        while self.map.len() + entries > self.max_entries || self.bytes + bytes > self.max_bytes {
            let map = &self.map;
            let Some(at) = self
                .order
                .iter()
                .position(|k| map.get(k).is_none_or(|(v, _)| !pinned(k, v)))
            else {
                break;
            };
            let old = self.order.remove(at).expect("at is in the order");
            if let Some((_, b)) = self.map.remove(&old) {
                self.bytes -= b;
            }
        }
    }

    pub(crate) fn get(&self, id: &str) -> Option<&V> {
        self.map.get(id).map(|(v, _)| v)
    }

    /// Changes entry `id` by `f`, which takes it and its cost and gives its result and new
    /// cost (`None`: not kept). Nothing is dropped for room: the caller does that
    /// ([`Kept::make_room`]).
    pub(crate) fn update<R>(
        &mut self,
        id: &str,
        f: impl FnOnce(&mut V, usize) -> (R, usize),
    ) -> Option<R> {
        let (v, bytes) = self.map.get_mut(id)?;
        let (r, now) = f(v, *bytes);
        self.bytes = self.bytes - *bytes + now;
        *bytes = now;
        Some(r)
    }

    /// The cost entry `id` is kept at.
    pub(crate) fn cost(&self, id: &str) -> Option<usize> {
        self.map.get(id).map(|(_, b)| *b)
    }

    pub(crate) fn remove(&mut self, id: &str) -> Option<V> {
        let (v, b) = self.map.remove(id)?;
        self.bytes -= b;
        self.order.retain(|k| k != id);
        Some(v)
    }

    /// Moves `id` to the back (used last).
    pub(crate) fn touch(&mut self, id: &str) {
        if let Some(at) = self.order.iter().position(|k| k == id) {
            let k = self.order.remove(at).expect("at is in the order");
            self.order.push_back(k);
        }
    }

    /// The ids, the one used longest ago (or put first) first.
    pub(crate) fn ids(&self) -> impl Iterator<Item = &String> {
        self.order.iter()
    }

    /// The bytes of every entry together.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Each entry and its cost (in no order).
    #[cfg(test)]
    pub(crate) fn entries(&self) -> impl Iterator<Item = (&String, &V, usize)> {
        self.map.iter().map(|(k, (v, b))| (k, v, *b))
    }
}

/// Changes a value kept as JSON text by `f` (nothing where the text is not JSON, which the
/// stores never write): the value as changed, and `cost`, the entry's, with the text's change
/// in length (for [`Kept::update`]).
pub(crate) fn edit_json(
    text: &mut Box<str>,
    cost: usize,
    f: impl FnOnce(&mut serde_json::Value),
) -> (Option<serde_json::Value>, usize) {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(text) else {
        return (None, cost);
    };
    f(&mut v);
    let new = v.to_string().into_boxed_str();
    let cost = cost - text.len() + new.len();
    *text = new;
    (Some(v), cost)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn consistent(k: &Kept<u32>) {
        assert_eq!(k.bytes(), k.entries().map(|(_, _, b)| b).sum::<usize>());
        assert_eq!(k.order.len(), k.len());
        assert!(k.order.iter().all(|id| k.map.contains_key(id)));
    }

    #[test]
    fn the_oldest_unpinned_go_first_under_either_limit() {
        let mut k = Kept::new(3, 100);
        let none = |_: &str, _: &u32| false;
        for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
            assert!(k.insert(id.into(), i as u32, 10, none));
        }
        k.touch("a");
        // the count: b (used longest ago) goes
        k.insert("d".into(), 3, 10, none);
        assert!(k.get("b").is_none() && k.get("a").is_some());
        consistent(&k);
        // the count takes c, the bytes a for 90 more; d is pinned
        k.insert("e".into(), 4, 90, |_, v| *v == 3);
        assert!(k.get("c").is_none() && k.get("a").is_none());
        assert_eq!((k.get("d"), k.get("e")), (Some(&3), Some(&4)));
        consistent(&k);
        // too big alone: not kept, nothing dropped
        assert!(!k.insert("f".into(), 5, 101, none));
        assert_eq!(k.len(), 2);
        // only pinned ones left: kept past the count
        let mut p = Kept::new(1, 100);
        p.insert("x".into(), 1, 1, none);
        p.insert("y".into(), 2, 1, |_, _| true);
        assert_eq!(p.len(), 2);
        consistent(&p);
    }

    #[test]
    fn updates_and_replacements_keep_the_sum() {
        let mut k = Kept::new(8, 100);
        k.insert("a".into(), 1, 10, |_, _| false);
        k.insert("a".into(), 2, 20, |_, _| false);
        assert_eq!((k.len(), k.bytes()), (1, 20));
        assert_eq!(k.update("a", |v, b| (*v + b as u32, 35)), Some(22));
        assert_eq!((k.cost("a"), k.bytes()), (Some(35), 35));
        assert_eq!(k.update("zz", |v, _| (*v, 1)), None);
        assert_eq!(k.remove("a"), Some(2));
        assert_eq!(k.bytes(), 0);
        consistent(&k);
    }
}
