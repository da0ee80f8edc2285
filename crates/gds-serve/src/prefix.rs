//! Prefix sharing: a radix tree over token ids whose edges are whole KV blocks.
//!
//! Every node stands for one full block of prompt tokens, reached from the root by the
//! blocks before it, and holds one reference on the KV block that stores their keys and
//! values. A new request walks the tree with its prompt and starts with the blocks it
//! finds (retained, never written again: only full blocks are shared), so a repeated
//! system prompt is prefilled once. Blocks that only the tree still references are evicted
//! least recently used first, leaves before their parents, when the pool runs dry.
//!
//! A sequence's last, partly filled block is indexed too, as a leaf whose key is shorter
//! than a block (without a window pool): its first rows are final, while its owner may go
//! on writing the rows after them. A request whose prompt goes on from the shared blocks
//! with some of the same tokens as a child's key ([`PrefixCache::partial`]: a partial leaf,
//! or a full block its prompt leaves mid-way) copies that block and starts after the common
//! tokens, so a repeated prompt computes only its last token, as llama-server's slots do.
//!
//! With a window pool (sliding-window layers in blocks of their own, released behind the
//! window) a node also holds the window-layer block of its positions while the sequence
//! that indexed it still had it. A match is then usable only up to a length whose window
//! (the blocks the next query reads) is all held: a window layer's keys depend on every
//! earlier position, so they cannot be recomputed for part of a prefix. Window blocks that
//! only the tree holds are released first when the window pool runs dry.

use gds_runtime::{KvCache, NO_BLOCK};
use std::collections::HashMap;

struct Node {
    block: u32,
    /// The window-pool block of the same positions ([`NO_BLOCK`]: not held).
    window: u32,
    parent: usize,
    /// The tokens of this block (the key in the parent's children).
    key: Vec<u32>,
    children: HashMap<Vec<u32>, usize>,
    last_used: u64,
}

/// The tree. Node 0 is the root (no block).
pub struct PrefixCache {
    block: usize,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<usize>,
    clock: u64,
    len: usize,
}

impl PrefixCache {
    /// An empty tree for blocks of `block` positions.
    pub fn new(block: usize) -> PrefixCache {
        let root = Node {
            block: u32::MAX,
            window: NO_BLOCK,
            parent: 0,
            key: Vec::new(),
            children: HashMap::new(),
            last_used: 0,
        };
        PrefixCache {
            block: block.max(1),
            nodes: vec![Some(root)],
            free_ids: Vec::new(),
            clock: 0,
            len: 0,
        }
    }

    /// Number of blocks indexed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("live node")
    }

    /// The blocks holding the longest indexed prefix of `tokens`, at most `max_blocks` of
    /// them, in order: (main block, window block or [`NO_BLOCK`]). The caller retains the
    /// ones it keeps.
    pub fn lookup(&mut self, tokens: &[u32], max_blocks: usize) -> Vec<(u32, u32)> {
        self.clock += 1;
        let now = self.clock;
        self.path(tokens, max_blocks)
            .into_iter()
            .map(|id| {
                let n = self.node_mut(id);
                n.last_used = now;
                (n.block, n.window)
            })
            .collect()
    }

    /// The nodes of the longest indexed prefix of `tokens`' full blocks, at most
    /// `max_blocks` of them, from the root's child on.
    fn path(&self, tokens: &[u32], max_blocks: usize) -> Vec<usize> {
        let mut at = 0;
        let mut out = Vec::new();
        for chunk in tokens.chunks_exact(self.block).take(max_blocks) {
            let Some(&next) = self.node(at).children.get(chunk) else {
                break;
            };
            out.push(next);
            at = next;
        }
        out
    }

    /// Indexes the full blocks of `tokens`, stored in `blocks` (the table of the sequence
    /// that computed them; only `tokens.len() / block` of them are used) and, with a window
    /// pool, `windows` (its window table). Blocks already indexed under the same tokens are
    /// kept (a node without its window block takes the caller's); new nodes retain theirs.
    pub fn insert(&mut self, tokens: &[u32], blocks: &[u32], windows: &[u32], kv: &mut KvCache) {
        self.clock += 1;
        let now = self.clock;
        let mut at = 0;
        for (i, (chunk, &b)) in tokens.chunks_exact(self.block).zip(blocks).enumerate() {
            let w = windows.get(i).copied().unwrap_or(NO_BLOCK);
            let next = match self.node(at).children.get(chunk) {
                Some(&next) => {
                    let n = self.node_mut(next);
                    if n.window == NO_BLOCK && w != NO_BLOCK {
                        n.window = w;
                        kv.retain_window(w);
                    }
                    next
                }
                None => {
                    // (a partly filled block of these tokens was indexed before this full
                    // one existed: with it there, no other is)
                    self.drop_covered_tails(at, chunk, kv);
                    kv.retain(b);
                    if w != NO_BLOCK {
                        kv.retain_window(w);
                    }
                    let node = Node {
                        block: b,
                        window: w,
                        parent: at,
                        key: chunk.to_vec(),
                        children: HashMap::new(),
                        last_used: now,
                    };
                    self.add(node)
                }
            };
            self.node_mut(next).last_used = now;
            at = next;
        }
        // the partly filled last block, as a leaf, where no child already holds its tokens
        // (a window pool's blocks are released by position: no partial blocks there)
        let full = tokens.len() / self.block;
        let tail = &tokens[full * self.block..];
        // (`blocks` holding the tail's block: the loop above went through every full one)
        let Some(&b) = blocks.get(full) else { return };
        if tail.is_empty() || kv.pool_window().is_some() {
            return;
        }
        if !self.node(at).children.keys().any(|k| k.starts_with(tail)) {
            // (a shorter tail of the same tokens, the same sequence's earlier, goes)
            self.drop_covered_tails(at, tail, kv);
            kv.retain(b);
            self.add(Node {
                block: b,
                window: NO_BLOCK,
                parent: at,
                key: tail.to_vec(),
                children: HashMap::new(),
                last_used: now,
            });
        }
    }

    /// Drops the partly filled blocks under `at` whose tokens start `chunk` (a full block, or
    /// a longer partly filled one, holds them now: a leftover would keep its parent from
    /// being evicted or erased, and hold a block for nothing).
    fn drop_covered_tails(&mut self, at: usize, chunk: &[u32], kv: &mut KvCache) {
        let covered: Vec<usize> = self
            .node(at)
            .children
            .iter()
            .filter(|(k, _)| k.len() < self.block && k.len() < chunk.len() && chunk.starts_with(k))
            .map(|(_, &id)| id)
            .collect();
        for id in covered {
            self.remove(id, kv);
        }
    }

    /// Takes leaf `id` out of the tree, releasing its blocks.
    fn remove(&mut self, id: usize, kv: &mut KvCache) {
        let node = self.nodes[id].take().expect("live node");
        self.node_mut(node.parent).children.remove(&node.key);
        self.free_ids.push(id);
        self.len -= 1;
        kv.release(node.block);
        if node.window != NO_BLOCK {
            kv.release_window(node.window);
        }
    }

    /// Puts `node` in the tree under its parent; its id.
    fn add(&mut self, node: Node) -> usize {
        let (parent, key) = (node.parent, node.key.clone());
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        self.node_mut(parent).children.insert(key, id);
        self.len += 1;
        id
    }

    /// Evicts up to `want` blocks that nothing but the tree references (leaves, least
    /// recently used first), returning them to the pool. Returns how many were freed.
    pub fn evict(&mut self, kv: &mut KvCache, want: usize) -> usize {
        let mut freed = 0;
        while freed < want {
            let victim = self
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
                .filter(|(_, n)| n.children.is_empty() && kv.refcount(n.block) == 1)
                .min_by_key(|(_, n)| n.last_used)
                .map(|(id, _)| id);
            let Some(id) = victim else { break };
            self.remove(id, kv);
            freed += 1;
        }
        freed
    }

    /// Drops the blocks of `tokens`' indexed prefix that nothing else needs: from its last
    /// block back, each one no other prefix continues and no sequence references (a slot's
    /// erase). Returns how many were freed.
    pub fn erase(&mut self, tokens: &[u32], kv: &mut KvCache) -> usize {
        let mut path = self.path(tokens, usize::MAX);
        // its partly filled last block first (a leaf)
        let tail = &tokens[path.len() * self.block..];
        if path.len() == tokens.len() / self.block && !tail.is_empty() {
            let at = path.last().copied().unwrap_or(0);
            if let Some(&id) = self.node(at).children.get(tail) {
                path.push(id);
            }
        }
        let mut freed = 0;
        for id in path.into_iter().rev() {
            let n = self.node(id);
            if !n.children.is_empty() || kv.refcount(n.block) != 1 {
                break;
            }
            self.remove(id, kv);
            freed += 1;
        }
        freed
    }

    /// After the first `n_full` blocks of `tokens` (indexed: [`PrefixCache::lookup`] found
    /// them), the child whose key shares the longest start with the tokens that follow: its
    /// block and how many tokens it shares (at least one), or `None`.
    pub fn partial(&mut self, tokens: &[u32], n_full: usize) -> Option<(u32, usize)> {
        let path = self.path(tokens, n_full);
        if path.len() < n_full {
            return None;
        }
        let at = path.last().copied().unwrap_or(0);
        let rest = tokens.get(n_full * self.block..)?;
        let (common, id) = self
            .node(at)
            .children
            .values()
            .map(|&c| {
                let key = &self.node(c).key;
                let n = key.iter().zip(rest).take_while(|(a, b)| a == b).count();
                (n, c)
            })
            .max_by_key(|&(n, c)| (n, self.node(c).last_used))?;
        if common == 0 {
            return None;
        }
        self.clock += 1;
        let now = self.clock;
        let n = self.node_mut(id);
        n.last_used = now;
        Some((n.block, common))
    }

    /// Window-pool blocks that [`PrefixCache::evict_window`] could release now.
    pub fn evictable_window(&self, kv: &KvCache) -> usize {
        self.nodes
            .iter()
            .flatten()
            .filter(|n| n.window != NO_BLOCK && kv.window_refcount(n.window) == 1)
            .count()
    }

    /// Releases up to `want` window-pool blocks that nothing but the tree references, least
    /// recently used first (the nodes stay, their matches get shorter). Returns how many.
    pub fn evict_window(&mut self, kv: &mut KvCache, want: usize) -> usize {
        let mut held: Vec<(u64, usize)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
            .filter(|(_, n)| n.window != NO_BLOCK && kv.window_refcount(n.window) == 1)
            .map(|(id, n)| (n.last_used, id))
            .collect();
        held.sort_unstable();
        let mut freed = 0;
        for (_, id) in held.into_iter().take(want) {
            let n = self.node_mut(id);
            let w = std::mem::replace(&mut n.window, NO_BLOCK);
            kv.release_window(w);
            freed += 1;
        }
        freed
    }

    /// Blocks that [`PrefixCache::evict`] could free now.
    pub fn evictable(&self, kv: &KvCache) -> usize {
        // a node is evictable once its whole subtree is referenced by the tree alone
        fn walk(t: &PrefixCache, kv: &KvCache, id: usize) -> (usize, bool) {
            let n = t.node(id);
            let mut count = 0;
            let mut all = true;
            for &c in n.children.values() {
                let (k, a) = walk(t, kv, c);
                count += k;
                all &= a;
            }
            if id != 0 && all && kv.refcount(n.block) == 1 {
                (count + 1, true)
            } else {
                (count, false)
            }
        }
        walk(self, kv, 0).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gds_runtime::KvDtype;

    /// A pool of 8 blocks of 4 positions, an empty tree, and sequence 0 holding 3 blocks for
    /// the prompt 0..10 (two full blocks, one partial): (cache, tree, prompt, its table).
    fn ten_tokens() -> (KvCache, PrefixCache, Vec<u32>, Vec<u32>) {
        let mut kv = KvCache::paged(KvDtype::F32, 1, 2, 64, 4, 4, 8);
        for _ in 0..3 {
            let b = kv.alloc().unwrap();
            kv.push_block(0, b);
        }
        let table = kv.table(0).to_vec();
        (kv, PrefixCache::new(4), (0..10).collect(), table)
    }

    #[test]
    fn shares_full_blocks_and_evicts_only_unreferenced_leaves() {
        let (mut kv, mut t, prompt, table) = ten_tokens();
        t.insert(&prompt, &table, &[], &mut kv);
        assert_eq!(t.len(), 3, "the full blocks and the partial one");
        assert_eq!(kv.refcount(table[0]), 2);
        assert_eq!(kv.refcount(table[2]), 2);
        // the partial block's two tokens: a prompt going on from them shares them, one that
        // leaves them after one shares one, and one that leaves the second block mid-way
        // shares that block's start
        let mut longer = prompt.clone();
        longer.extend([50, 51]);
        assert_eq!(t.partial(&longer, 2), Some((table[2], 2)));
        assert_eq!(
            t.partial(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 77, 78], 2),
            Some((table[2], 1))
        );
        assert_eq!(t.partial(&[0, 1, 2, 3, 4, 5, 99], 1), Some((table[1], 2)));
        assert_eq!(t.partial(&[0, 1, 2, 3, 9], 1), None);
        assert_eq!(t.partial(&[5, 1, 2, 3, 4], 1), None, "no such first block");

        // the same first 9 tokens, then something else: two blocks shared
        let mut other: Vec<u32> = (0..9).collect();
        other.push(99);
        let main = |v: Vec<(u32, u32)>| v.into_iter().map(|(b, _)| b).collect::<Vec<_>>();
        assert_eq!(main(t.lookup(&other, 8)), table[..2].to_vec());
        assert_eq!(main(t.lookup(&other, 1)), table[..1].to_vec());
        // a different first block: nothing
        assert!(t.lookup(&[7, 1, 2, 3, 4], 8).is_empty());

        // while sequence 0 holds them, nothing can be evicted
        assert_eq!(t.evictable(&kv), 0);
        assert_eq!(t.evict(&mut kv, 8), 0);
        kv.release_seq(0);
        assert_eq!(t.evictable(&kv), 3);
        let free = kv.free_blocks();
        // the partial leaf (used least recently), then the second block
        assert_eq!(t.evict(&mut kv, 2), 2);
        assert_eq!(kv.free_blocks(), free + 2);
        assert_eq!(
            main(t.lookup(&prompt, 8)),
            table[..1].to_vec(),
            "the leaf went first"
        );
        assert_eq!(t.evict(&mut kv, 8), 1);
        assert!(t.is_empty());
        assert_eq!(kv.free_blocks(), 8);
    }

    #[test]
    fn a_partial_block_gives_way_to_the_full_block_that_holds_its_tokens() {
        let (mut kv, mut t, prompt, table) = ten_tokens();
        // the prompt indexed when it went in (its last block partly filled), then with one
        // token more: the longer tail replaces the shorter one ...
        t.insert(&prompt[..9], &table, &[], &mut kv);
        assert_eq!((t.len(), kv.refcount(table[2])), (3, 2));
        t.insert(&prompt, &table, &[], &mut kv);
        assert_eq!((t.len(), kv.refcount(table[2])), (3, 2));
        assert_eq!(t.partial(&prompt, 2), Some((table[2], 2)));
        // ... then the whole sequence, its third block full: the partial entry goes
        let all: Vec<u32> = (0..12).collect();
        t.insert(&all, &table, &[], &mut kv);
        assert_eq!((t.len(), kv.refcount(table[2])), (3, 2));
        assert_eq!(t.partial(&prompt, 2), Some((table[2], 2)));
        // and erasing the sequence frees all of it
        kv.release_seq(0);
        assert_eq!(t.erase(&all, &mut kv), 3);
        assert!(t.is_empty());
        // a cache with a window pool indexes whole blocks only
        let mut kv = KvCache::paged_windowed(KvDtype::F32, &[Some(4), None], 1, 64, 4, 4, 8, 8);
        let mut t = PrefixCache::new(4);
        let (b0, b1) = (kv.alloc().unwrap(), kv.alloc().unwrap());
        t.insert(&prompt[..6], &[b0, b1], &[], &mut kv);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn erase_frees_a_prefix_back_to_what_others_share() {
        let mut kv = KvCache::paged(KvDtype::F32, 1, 2, 64, 4, 4, 8);
        let mut t = PrefixCache::new(4);
        // two prompts sharing their first block
        let a: Vec<u32> = (0..12).collect();
        let mut b: Vec<u32> = (0..4).collect();
        b.extend(100..104);
        for (seq, p) in [(0, &a), (1, &b)] {
            for i in 0..p.len() / 4 {
                let blk = match (seq, i) {
                    (1, 0) => kv.table(0)[0],
                    _ => kv.alloc().unwrap(),
                };
                if (seq, i) == (1, 0) {
                    kv.retain(blk);
                }
                kv.push_block(seq, blk);
            }
            let table = kv.table(seq).to_vec();
            t.insert(p, &table, &[], &mut kv);
        }
        assert_eq!(t.len(), 4);
        // while a sequence holds them nothing goes
        assert_eq!(t.erase(&a, &mut kv), 0);
        kv.release_seq(0);
        kv.release_seq(1);
        let free = kv.free_blocks();
        // a's own two blocks go; the first, which b continues, stays
        assert_eq!(t.erase(&a, &mut kv), 2);
        assert_eq!((t.len(), kv.free_blocks()), (2, free + 2));
        assert_eq!(t.lookup(&a, 8).len(), 1);
        assert_eq!(t.lookup(&b, 8).len(), 2);
        // then b's, and the shared one with it
        assert_eq!(t.erase(&b, &mut kv), 2);
        assert!(t.is_empty());
        assert_eq!(kv.free_blocks(), 8);
        assert_eq!(t.erase(&b, &mut kv), 0);
    }

    #[test]
    fn window_blocks_ride_along_and_are_released_first() {
        // layer 0 windowed (window 4), layer 1 global; blocks of 2
        let mut kv = KvCache::paged_windowed(KvDtype::F32, &[Some(4), None], 1, 64, 4, 2, 8, 8);
        let mut t = PrefixCache::new(2);
        let prompt: Vec<u32> = (0..6).collect();
        for i in 0..3 {
            let (b, w) = (kv.alloc().unwrap(), kv.alloc_window().unwrap());
            kv.push_block(0, b);
            // block 0 was already released behind the window
            kv.push_window(0, if i == 0 { NO_BLOCK } else { w });
            if i == 0 {
                kv.release_window(w);
            }
        }
        let (main, win) = (kv.table(0).to_vec(), kv.window_table(0).to_vec());
        t.insert(&prompt, &main, &win, &mut kv);
        assert_eq!(
            t.lookup(&prompt, 8),
            vec![(main[0], NO_BLOCK), (main[1], win[1]), (main[2], win[2])]
        );
        assert_eq!(kv.window_refcount(win[1]), 2);
        // while the sequence holds them, nothing to release; then both window blocks
        assert_eq!(t.evictable_window(&kv), 0);
        kv.release_seq(0);
        assert_eq!(t.evictable_window(&kv), 2);
        assert_eq!(t.evict_window(&mut kv, 1), 1);
        assert_eq!(kv.window_free_blocks(), 7);
        assert_eq!(t.len(), 3, "the nodes stay; only their window blocks go");
        // a later sequence that holds the block gives it back to the node
        let w = kv.alloc_window().unwrap();
        let mut again = win.clone();
        let missing = if t.lookup(&prompt, 8)[1].1 == NO_BLOCK {
            1
        } else {
            2
        };
        again[missing] = w;
        t.insert(&prompt, &main, &again, &mut kv);
        assert_eq!(t.lookup(&prompt, 8)[missing].1, w);
        assert_eq!(kv.window_refcount(w), 2);
        // evicting the nodes releases their window blocks too
        kv.release_window(w);
        assert_eq!(t.evict(&mut kv, 8), 3);
        assert_eq!((kv.free_blocks(), kv.window_free_blocks()), (8, 8));
    }
}
