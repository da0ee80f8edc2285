//! Sizing the server's paged KV cache from `--kv-budget`: how many blocks the layers without
//! a window get, and how many the sliding-window layers' own pool needs (about the window per
//! sequence, released behind it, so a Gemma 3 budget holds several times the context).

use gds_runtime::{KvCache, KvDtype};

/// What the pool is sized from.
pub struct KvPoolArgs {
    /// Element type.
    pub dtype: KvDtype,
    /// Each layer's sliding window (`None`: sees the whole context).
    pub windows: Vec<Option<usize>>,
    /// Elements per position and layer (K or V).
    pub kv_dim: usize,
    /// Positions per block.
    pub block: usize,
    /// Context per sequence.
    pub ctx: usize,
    /// Sequences at once.
    pub max_batch: usize,
    /// Most positions one step adds (all sequences together).
    pub step: usize,
    /// Bytes for K and V together.
    pub budget: usize,
}

/// The sized pool.
#[derive(Debug, Clone, PartialEq)]
pub struct KvPool {
    /// The windows the cache is built with (all `None` when a window pool would not save).
    pub windows: Vec<Option<usize>>,
    /// Blocks of the layers without a window.
    pub n_blocks: usize,
    /// Blocks of the window layers' pool (0: none).
    pub n_window_blocks: usize,
    /// Bytes the whole pool takes.
    pub bytes: usize,
    /// Blocks the same budget would give without a window pool.
    pub plain_blocks: usize,
    /// Where the model has window layers but the budget is too small for their pool to
    /// pay: the budget, bytes, above which it would.
    pub window_pool_needs: Option<usize>,
}

impl KvPool {
    /// Sizes the pool, or says why the budget cannot hold one sequence's context.
    ///
    /// The window layers get a pool of their own only where it can hold what `max_batch`
    /// sequences can need at once (each its window behind a block boundary, plus the
    /// step's new positions among them) in fewer blocks than a plain pool of the same
    /// budget: then no mix of requests fits worse than in the plain pool, and the layers
    /// without a window get the rest of the budget.
    pub fn size(a: &KvPoolArgs) -> Result<KvPool, String> {
        let n_layers = a.windows.len();
        let block = a.block.max(1);
        let per_seq = a.ctx.div_ceil(block);
        let layer_block = |layers: usize| KvCache::paged_bytes(a.dtype, layers, a.kv_dim, block, 1);
        let plain_blocks = a.budget / layer_block(n_layers).max(1);
        // one sequence never adds more than its context in a step
        let step = a.step.min(a.ctx).max(1);
        let window = a.windows.iter().flatten().copied().max();
        let most =
            window.map(|w| a.max_batch * ((w - 1).div_ceil(block) + 3) + step.div_ceil(block));
        let pooled = KvCache::window_blocks_per_seq(a.ctx, &a.windows, block, step).is_some()
            && most.is_some_and(|m| m < plain_blocks);
        let (windows, n_window_blocks) = match most {
            Some(m) if pooled => (a.windows.clone(), m),
            _ => (vec![None; n_layers], 0),
        };
        let n_win = windows.iter().flatten().count();
        let window_bytes = n_window_blocks * layer_block(n_win);
        let full_block = layer_block(n_layers - n_win);
        // every layer has a window: the main table only numbers the positions
        let n_blocks = a
            .budget
            .saturating_sub(window_bytes)
            .checked_div(full_block)
            .unwrap_or(per_seq * a.max_batch);
        if n_blocks > u32::MAX as usize || n_window_blocks > u32::MAX as usize {
            return Err(format!(
                "makes more than {} blocks (raise --kv-block)",
                u32::MAX
            ));
        }
        if n_blocks < per_seq {
            return Err(format!(
                "holds {n_blocks} blocks of {block} positions; one full context of {} needs {per_seq} (raise --kv-budget or lower --ctx)",
                a.ctx
            ));
        }
        Ok(KvPool {
            bytes: window_bytes + n_blocks * full_block,
            windows,
            n_blocks,
            n_window_blocks,
            plain_blocks,
            window_pool_needs: match most {
                Some(m) if !pooled && m < per_seq * a.max_batch => Some(m * layer_block(n_layers)),
                _ => None,
            },
        })
    }

    /// One line for the start-up summary: the blocks, and what the window pool saves.
    pub fn describe(&self, block: usize) -> String {
        let mib = self.bytes >> 20;
        let n_win = self.windows.iter().flatten().count();
        if n_win == 0 {
            let hint = self.window_pool_needs.map_or(String::new(), |b| {
                format!(
                    "; the sliding-window layers would keep only their window with --kv-budget over {} MiB",
                    b >> 20
                )
            });
            return format!(
                "{} blocks x {block} positions, {mib} MiB{hint}",
                self.n_blocks
            );
        }
        let window = self.windows.iter().flatten().max().copied().unwrap_or(0);
        if n_win == self.windows.len() {
            return format!(
                "every layer keeps only its {window}-position window: {} blocks x {block} positions, {mib} MiB, every sequence its whole context",
                self.n_window_blocks
            );
        }
        format!(
            "{} blocks x {block} positions, {mib} MiB; {n_win} of {} layers keep only their {window}-position window ({} blocks of their own), so the budget holds {} positions instead of {} ({:.1}x)",
            self.n_blocks,
            self.windows.len(),
            self.n_window_blocks,
            self.n_blocks * block,
            self.plain_blocks * block,
            self.n_blocks as f64 / self.plain_blocks.max(1) as f64
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(windows: Vec<Option<usize>>, budget: usize) -> KvPoolArgs {
        KvPoolArgs {
            dtype: KvDtype::F32,
            windows,
            kv_dim: 8,
            block: 16,
            ctx: 1024,
            max_batch: 2,
            step: 32,
            budget,
        }
    }

    #[test]
    fn window_layers_take_a_small_pool_and_the_rest_of_the_budget_goes_to_global_layers() {
        // Gemma 3's pattern: 5 windowed layers of 6, window 64
        let windows: Vec<_> = (0..6).map(|l| ((l + 1) % 6 != 0).then_some(64)).collect();
        let block_bytes = 2 * 8 * 16 * 4; // one layer's K and V for one block
        let p = KvPool::size(&args(windows.clone(), 600 * block_bytes)).unwrap();
        // 2 sequences x ((64 - 1) / 16 rounded up + 3) + a step of 32 = 16 blocks
        assert_eq!(p.n_window_blocks, 16);
        assert_eq!(
            p.n_blocks,
            600 - 5 * 16,
            "the rest for the one global layer"
        );
        assert_eq!(p.plain_blocks, 100);
        assert_eq!(p.bytes, (16 * 5 + p.n_blocks) * block_bytes);
        assert!(
            p.describe(16).contains("5 of 6 layers"),
            "{}",
            p.describe(16)
        );
        // a budget whose plain pool is not larger than the window pool: the plain pool, and
        // the summary says from what budget the window pool would pay
        // (16 sequences: 16 x 7 + 2 = 114 window blocks, more than the plain 100)
        let many = |budget| KvPoolArgs {
            max_batch: 16,
            ..args(windows.clone(), budget)
        };
        let p = KvPool::size(&many(6 * 100 * block_bytes)).unwrap();
        assert_eq!((p.n_window_blocks, p.n_blocks), (0, 100));
        assert_eq!(p.windows, vec![None; 6]);
        assert!(p.describe(16).contains("over 0 MiB"), "{}", p.describe(16));
        assert_eq!(p.window_pool_needs, Some(114 * 6 * block_bytes));
        let p = KvPool::size(&many(6 * 115 * block_bytes)).unwrap();
        assert_eq!((p.n_window_blocks, p.n_blocks), (114, 6 * 115 - 5 * 114));
        // a budget whose plain pool cannot hold one context, but that does with a window pool
        let p = KvPool::size(&args(windows.clone(), 6 * 60 * block_bytes)).unwrap();
        assert_eq!((p.n_window_blocks, p.n_blocks), (16, 6 * 60 - 5 * 16));
        let e = KvPool::size(&args(windows, 6 * 10 * block_bytes)).unwrap_err();
        assert!(e.contains("one full context of 1024 needs 64"), "{e}");
        // a window as long as the context: no window pool, nothing to say about one
        let p = KvPool::size(&args(vec![Some(1024), None], 200 * block_bytes)).unwrap();
        assert_eq!((p.n_window_blocks, p.n_blocks), (0, 100));
        assert_eq!(p.windows, vec![None, None]);
        assert_eq!(p.window_pool_needs, None);
        // every layer windowed (Mistral): the main table only numbers positions
        let p = KvPool::size(&args(vec![Some(64); 2], 36 * block_bytes)).unwrap();
        assert_eq!(
            (p.n_window_blocks, p.n_blocks, p.bytes),
            (16, 128, 32 * block_bytes)
        );
        assert!(
            p.describe(16).contains("whole context"),
            "{}",
            p.describe(16)
        );
    }
}
