#![doc = include_str!("../README.md")]

use gds_format::raw::CHECKSUM_OFFSET;
use gds_format::reader::Value as MetaValue;
/// The chat templates' memory bound, installed around [`CappedAlloc`] by the fuzz targets and
/// the replay test (so a template that doubles a value meets its bound before the cap).
pub use gds_format::render_memory::TemplateAllocator;
use gds_runtime::chat::Message;
use gds_runtime::tokenizer::TextTokenizer;
use serde_json::Value;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The targets, which are also the directory names under `fuzz/seeds/`, `fuzz/regressions/`
/// and `fuzz/corpus/`.
pub const TARGETS: &[&str] = &[
    "manifest",
    "gguf",
    "safetensors",
    "tokenizer",
    "chat_template",
    "imatrix",
    "grammar",
];

/// Separates the files of a multi-file input (`safetensors`, `tokenizer`).
pub const FILE_SEP: &[u8] = b"\n%%%%\n";

/// Most bytes a fuzz or replay process may hold at once through the Rust allocator. The inputs
/// are at most a few tens of KiB; the readers' fixed buffers (gguf's 1 MiB read buffer) and a
/// built tokenizer fit many times over, while anything sized by a hostile length does not.
pub const MEMORY_CAP: usize = 256 << 20;

/// A global allocator: [`System`], refusing any allocation that would take the bytes held at
/// once past a cap. A refused allocation is reported on stderr (with the input being run, see
/// [`set_current_input`]) and returns null, which makes Rust abort: a crash for libFuzzer, a
/// failed test for the replay.
pub struct CappedAlloc {
    cap: usize,
    live: AtomicUsize,
}

thread_local! {
    static CURRENT: Cell<&'static str> = const { Cell::new("") };
}

/// Names the input this thread is running, for [`CappedAlloc`]'s refusal message.
pub fn set_current_input(name: &'static str) {
    CURRENT.with(|c| c.set(name));
}

impl CappedAlloc {
    /// An allocator holding at most `cap` bytes at once.
    pub const fn new(cap: usize) -> CappedAlloc {
        CappedAlloc {
            cap,
            live: AtomicUsize::new(0),
        }
    }

    fn reserve(&self, n: usize) -> bool {
        // `n` is at most isize::MAX (a Layout's size), so with the cap far below that the sum
        // cannot wrap.
        let held = self.live.fetch_add(n, Ordering::Relaxed);
        if held + n <= self.cap {
            return true;
        }
        self.live.fetch_sub(n, Ordering::Relaxed);
        let input = CURRENT.try_with(Cell::get).unwrap_or("");
        // straight to stderr, without allocating: the process aborts right after
        let _ = writeln!(
            std::io::stderr(),
            "gds-fuzz: refused an allocation of {n} bytes ({held} held, cap {}){}{input}",
            self.cap,
            if input.is_empty() { "" } else { " running " },
        );
        false
    }

    fn release(&self, n: usize) {
        self.live.fetch_sub(n, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's layout, pointer and size
// unchanged; the counter only decides whether to forward (returning null, which callers must
// handle, when it does not).
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !self.reserve(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, forwarded.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            self.release(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !self.reserve(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, forwarded.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            self.release(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with `layout` (every allocation is forwarded).
        unsafe { System.dealloc(ptr, layout) };
        self.release(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !self.reserve(new_size - old) {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr` came from `System` with `layout`; `new_size` is the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            if new_size > old {
                self.release(new_size - old);
            }
        } else if new_size < old {
            self.release(old - new_size);
        }
        p
    }
}

/// For the fuzz targets: libfuzzer-sys makes every panic abort, even one the code under test
/// catches on purpose (the runtime turns the `tokenizers` crate's panics into errors). This
/// hook prints the panic (with a backtrace when `RUST_BACKTRACE` asks for one: a campaign
/// catches thousands of panics on purpose, and a trace each fills the disk) and lets it
/// unwind; a panic nobody catches reaches libfuzzer-sys's own `catch_unwind`, which aborts:
/// still a crash. Replay the crashing input with `RUST_BACKTRACE=1` for its trace.
pub fn init_fuzzing() {
    // a chat template stopped at its memory bound leaves that memory parked (see
    // gds_format::render_memory): at most 8 of them must fit under MEMORY_CAP beside the work
    // (found by the campaign: 4 parked renders of 64 MiB took the process past its cap)
    gds_format::render_memory::set_bound(MEMORY_CAP / 16);
    std::panic::set_hook(Box::new(|info| {
        eprintln!("{info}\n{}", std::backtrace::Backtrace::capture());
    }));
}

/// Runs target `name` on `data`: whether the input was accepted (see each target), or `None`
/// when there is no such target.
pub fn run(name: &str, data: &[u8]) -> Option<bool> {
    Some(match name {
        "manifest" => manifest(data),
        "gguf" => gguf(data),
        "safetensors" => safetensors(data),
        "tokenizer" => tokenizer(data),
        "chat_template" => chat_template(data),
        "imatrix" => imatrix(data),
        "grammar" => grammar(data),
        _ => return None,
    })
}

/// Splits a multi-file input at [`FILE_SEP`].
pub fn split_files(data: &[u8]) -> Vec<&[u8]> {
    let mut parts = Vec::new();
    let mut rest = data;
    while let Some(i) = rest.windows(FILE_SEP.len()).position(|w| w == FILE_SEP) {
        parts.push(&rest[..i]);
        rest = &rest[i + FILE_SEP.len()..];
    }
    parts.push(rest);
    parts
}

/// A fresh scratch directory, in `/dev/shm` when there is one (fuzzing writes a file per run).
fn scratch() -> tempfile::TempDir {
    let b = tempfile::Builder::new().prefix("gds-fuzz-").clone();
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(d) = b.tempdir_in(shm) {
            return d;
        }
    }
    b.tempdir().expect("a scratch directory")
}

fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).expect("write a scratch file");
}

/// The manifest reader and validator, every accessor, and what the runtime reads from a
/// manifest it accepted (the model config, then the GPU layout, as `Plan::build` does).
/// Inputs whose checksum does not match are also run with the checksum recomputed, so that
/// mutations reach past the checksum test. Accepted: the runtime built its model config.
pub fn manifest(data: &[u8]) -> bool {
    let mut ok = manifest_once(data);
    let (a, b) = (CHECKSUM_OFFSET, CHECKSUM_OFFSET + 32);
    if data.len() >= b {
        let sum = gds_format::reader::checksum(data);
        if data[a..b] != sum {
            let mut fixed = data.to_vec();
            fixed[a..b].copy_from_slice(&sum);
            ok |= manifest_once(&fixed);
        }
    }
    ok
}

fn manifest_once(data: &[u8]) -> bool {
    let (m, errs) = gds_format::validate::validate_manifest(data);
    for e in &errs {
        let _ = e.to_string();
    }
    let Some(m) = m else { return false };
    let _ = (
        m.bytes().len(),
        m.header(),
        m.version(),
        m.verify_checksum(),
    );
    let (kv, layers, tensors) = (m.kv_table(), m.layer_table(), m.tensor_table());
    let _ = (kv.is_empty(), kv.get(kv.len()), kv.iter().count());
    let _ = (
        layers.is_empty(),
        layers.get(layers.len()),
        layers.iter().count(),
    );
    let _ = (
        tensors.is_empty(),
        tensors.get(tensors.len()),
        tensors.iter().count(),
    );
    for i in 0..=kv.len() {
        if let Ok((_, v)) = m.kv(i) {
            let _ = v.to_string();
        }
    }
    // every typed getter on one key of each value type (the getters scan the table)
    let mut seen = [false; 5];
    for (k, v) in m.kvs() {
        let t = match v {
            MetaValue::U64(_) => 0,
            MetaValue::I64(_) => 1,
            MetaValue::F64(_) => 2,
            MetaValue::Bool(_) => 3,
            MetaValue::Str(_) => 4,
        };
        if !std::mem::replace(&mut seen[t], true) {
            let _ = (m.get_u64(k), m.get_f64(k), m.get_str(k), m.get_bool(k));
        }
    }
    for i in 0..=m.n_layers() {
        if let Ok(l) = m.layer(i) {
            let _ = (l.name, l.file, l.kind, l.block, l.file_size);
        }
    }
    for i in 0..=m.n_tensors() {
        if let Ok(t) = m.tensor(i) {
            let _ = t.dims();
        }
    }
    // (find_tensor scans the table: once for a present name, once for an absent one)
    if let Ok(t) = m.tensor(m.n_tensors().saturating_sub(1)) {
        let _ = m.find_tensor(t.name);
    }
    let _ = m.find_tensor("no such tensor");
    let _ = (m.kvs().count(), m.layers().count(), m.tensors().count());
    let _ = m.get("general.architecture");

    let dir = Path::new("model.gds");
    if let Ok(m) = gds_runtime::plan::parse_manifest(dir, data) {
        for l in m.layers() {
            for j in l.tensors {
                let _ = m.tensor(j).map(|t| t.n_elements());
            }
        }
        if let Ok(cfg) = gds_runtime::Config::from_manifest(&m) {
            let _ = (cfg.q_dim(), cfg.kv_dim());
            let _ = gds_cuda::plan::Layout::from_manifest(dir, &m);
            return true;
        }
    }
    false
}

/// `gdsconv convert`'s GGUF reader on `data` as a `.gguf` file (header pre-scan, gguf-rs
/// decode, tensor bounds checks, hyperparameters, the embedded tokenizer's export).
/// Accepted: the reader returned a model.
pub fn gguf(data: &[u8]) -> bool {
    let dir = scratch();
    let path = dir.path().join("model.gguf");
    put(dir.path(), "model.gguf", data);
    read_source(&path)
}

/// `gdsconv convert --imatrix`'s reader on `data` as an importance matrix file (GGUF or
/// legacy `.dat`), and the lookup a conversion makes of each entry. Accepted: the reader
/// returned entries, each a whole number of rows of finite, non-negative weights.
pub fn imatrix(data: &[u8]) -> bool {
    let dir = scratch();
    let path = dir.path().join("imatrix.gguf");
    put(dir.path(), "imatrix.gguf", data);
    match gds_convert::imatrix::read_imatrix(&path) {
        Ok(m) => {
            for (name, e) in &m.entries {
                assert!(
                    e.n_mat > 0 && e.weights.len().is_multiple_of(e.n_mat),
                    "{name}"
                );
                assert!(
                    e.weights.iter().all(|w| w.is_finite() && *w >= 0.0),
                    "{name}"
                );
                let cols = (e.weights.len() / e.n_mat) as u64;
                assert!(m
                    .weights_for(name, cols, e.n_mat as u64)
                    .is_ok_and(|w| w.is_some()));
                let _ = m.weights_for(name, cols + 1, 1).map_err(|e| e.to_string());
            }
            true
        }
        Err(e) => {
            let _ = e.to_string();
            false
        }
    }
}

fn read_source(input: &Path) -> bool {
    match gds_convert::open_source(input) {
        Ok(mut src) => {
            // the GGUF tokenizer export runs on the same hostile metadata
            src.finish_tokenizer();
            check_source(&src);
            true
        }
        Err(e) => {
            let _ = e.to_string();
            false
        }
    }
}

/// `gdsconv convert`'s safetensors reader on a Hugging Face directory made of the parts of
/// `data` (split at [`FILE_SEP`]): 0 the first shard, 1 `config.json`,
/// 2 `model.safetensors.index.json`, 3 the second shard, 4 `tokenizer_config.json`,
/// 5 `generation_config.json`. Empty or absent parts are absent files. With neither an index
/// nor a second shard the first is `model.safetensors`; otherwise the shards are
/// `model-00001-of-00002.safetensors` and `model-00002-of-00002.safetensors`. Accepted: the
/// reader returned a model.
pub fn safetensors(data: &[u8]) -> bool {
    let parts = split_files(data);
    let part = |i: usize| parts.get(i).copied().filter(|p| !p.is_empty());
    let dir = scratch();
    let d = dir.path();
    if part(2).is_none() && part(3).is_none() {
        put(d, "model.safetensors", parts[0]);
    } else {
        put(d, "model-00001-of-00002.safetensors", parts[0]);
        if let Some(p) = part(3) {
            put(d, "model-00002-of-00002.safetensors", p);
        }
    }
    for (i, name) in [
        (1, "config.json"),
        (2, "model.safetensors.index.json"),
        (4, "tokenizer_config.json"),
        (5, "generation_config.json"),
    ] {
        if let Some(p) = part(i) {
            put(d, name, p);
        }
    }
    read_source(d)
}

/// The tokenizer loaders. The first byte picks what the rest is:
///
/// * even: `gdsrun`'s loader ([`TextTokenizer::load`]) on a model directory holding part 0 of
///   the rest (split at [`FILE_SEP`]) as `tokenizer_config.json` (absent when empty) and part
///   1 as `tokenizer.json` (a small built-in one when absent or empty), both listed in its
///   manifest; bit 1 gives the model
///   config BOS/EOS ids, bit 2 sets its `add_bos`. A tokenizer that loads renders the chat
///   template (minijinja) and encodes, decodes and stream-decodes.
/// * odd: the GGUF vocabulary exporter ([`gds_convert::tokenizer::tokenizer_from_gguf`]) on
///   the rest as a JSON object of GGUF metadata; an export must load (see `check_export`).
///
/// Accepted: the loader returned a tokenizer, or the exporter an export.
pub fn tokenizer(data: &[u8]) -> bool {
    let Some((&mode, rest)) = data.split_first() else {
        return false;
    };
    if mode & 1 == 1 {
        let Ok(meta) = serde_json::from_slice::<BTreeMap<String, Value>>(rest) else {
            return false;
        };
        return match gds_convert::tokenizer::tokenizer_from_gguf(&meta) {
            Ok(export) => {
                check_export(&export.tokenizer_json, &export.tokenizer_config_json);
                true
            }
            Err(e) => {
                let _ = e.to_string();
                false
            }
        };
    }
    let parts = split_files(rest);
    let json = parts
        .get(1)
        .copied()
        .filter(|p| !p.is_empty())
        .unwrap_or(TINY_TOKENIZER_JSON.as_bytes());
    let cfg = parts.first().copied().filter(|p| !p.is_empty());
    let dir = tokenizer_dir(json, cfg);
    match TextTokenizer::load(dir.path(), &model_config(mode)) {
        Ok(t) => {
            exercise(&t);
            true
        }
        Err(_) => false,
    }
}

/// A chat template, code from the model file, through the one policy every reader uses
/// ([`gds_format::chat_template`]): the check `gdsconv` runs, then, for one that compiles,
/// renders of a conversation with and without tools. Every outcome must be a value or an
/// error: the bounds (source size, parser recursion, fuel, output size) are what keep a
/// hostile template from aborting or exhausting the process. Accepted: it compiled.
pub fn chat_template(data: &[u8]) -> bool {
    use gds_format::chat_template::{check, ChatTemplate, Message};
    let Ok(src) = std::str::from_utf8(data) else {
        return false;
    };
    // refused for a limit (fuel, output, memory): refused everywhere, rendered nowhere (and a
    // render stopped at the memory bound leaves its memory parked: one per such input)
    if check(src).is_err_and(|e| e.limit) {
        return false;
    }
    let Ok(t) = ChatTemplate::new(src, "<s>", "</s>") else {
        return false;
    };
    let mut msgs = vec![
        Message::new("system", "Be brief."),
        Message::new("user", "Hi <|im_start|> there"),
        Message::new("assistant", "Hello!"),
        Message::new("user", "Bye \u{e9}\u{1f600}"),
    ];
    let _ = t.render(&msgs, true);
    let _ = t.render(&msgs[1..2], false);
    msgs[2].tool_calls = Some(serde_json::json!([{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]));
    msgs.push(Message {
        tool_call_id: Some("call_1".into()),
        ..Message::new("tool", "{\"temp\": 21}")
    });
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather of a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let _ = t.render_with_tools(&msgs, true, Some(&tools));
    true
}

/// A grammar from a client: a request's `grammar` (GBNF or Lark), `regex` or `json_schema`,
/// compiled as the server compiles it ([`Grammar::from_text`], then
/// [`GrammarCompiler::compile`], which computes the first mask too) against a small
/// vocabulary (every byte, some multi-byte pieces of JSON and text, end-of-generation
/// tokens), then walked: each byte after [`FILE_SEP`] picks one of the allowed tokens, for up
/// to 64 tokens, as the engine's masks and `accept` do. Everything a grammar does to the
/// process (a panic, memory past the cap, a mask that never ends) is a finding. The input: a
/// mode byte (0: the text as the `grammar` field, 1: Lark, 2: a regular expression, 3: a JSON
/// schema), the source, then the walk. Accepted: it compiled.
///
/// [`Grammar::from_text`]: gds_runtime::Grammar::from_text
/// [`GrammarCompiler::compile`]: gds_runtime::GrammarCompiler::compile
pub fn grammar(data: &[u8]) -> bool {
    use gds_runtime::Grammar;
    let Some((&mode, rest)) = data.split_first() else {
        return false;
    };
    let parts = split_files(rest);
    let Ok(src) = std::str::from_utf8(parts[0]) else {
        return false;
    };
    let g = match mode % 4 {
        0 => match Grammar::from_text(src) {
            Ok(g) => g,
            Err(_) => return false,
        },
        1 => Grammar::Lark(src.to_string()),
        2 => Grammar::Regex(src.to_string()),
        _ => match serde_json::from_str(src) {
            Ok(v) => Grammar::JsonSchema(v),
            Err(_) => return false,
        },
    };
    let GrammarVocab {
        compiler,
        n_vocab,
        eog,
    } = grammar_compiler();
    let n_vocab = *n_vocab;
    let Ok(mut c) = compiler.compile(&g) else {
        return false;
    };
    let mut logits = vec![0f32; n_vocab];
    for &b in parts.get(1).copied().unwrap_or(&[]).iter().take(64) {
        let Ok(mask) = c.compute_mask() else {
            break;
        };
        logits.fill(0.0);
        if mask.apply(&mut logits).is_err() {
            break;
        }
        let allowed: Vec<u32> = (0..n_vocab as u32)
            .filter(|&i| logits[i as usize] == 0.0)
            .collect();
        let tok = allowed[usize::from(b) % allowed.len()];
        if eog.contains(&tok) || c.accept(tok).is_err() || c.is_finished() {
            break;
        }
    }
    true
}

/// [`grammar`]'s vocabulary, compiled once per process (building it indexes the tokens).
struct GrammarVocab {
    compiler: gds_runtime::GrammarCompiler,
    n_vocab: usize,
    /// The end-of-generation ids (the tiny tokenizer's).
    eog: Vec<u32>,
}

/// Ids 0-2 special (the tiny tokenizer's), then every byte but 0xff (llguidance's
/// special-token marker), then multi-byte pieces.
fn grammar_compiler() -> &'static GrammarVocab {
    static VOCAB: std::sync::OnceLock<GrammarVocab> = std::sync::OnceLock::new();
    VOCAB.get_or_init(|| {
        let dir = tokenizer_dir(TINY_TOKENIZER_JSON.as_bytes(), None);
        let mut cfg = model_config(2);
        cfg.eos_token_id = Some(2);
        let t = TextTokenizer::load(dir.path(), &cfg).expect("the tiny tokenizer loads");
        let mut bytes: Vec<Vec<u8>> = vec![Vec::new(); 3];
        bytes.extend((0u8..0xff).map(|b| vec![b]));
        for piece in [
            "{\"", "\":", "\",\"", "\"}", "[\"", "\"]", "true", "false", "null", "  ", "\n\n",
            "ab", "abc", "123", "0.5", "-1", "e+", "\\u00", "\\\"", "é", "😀", "\u{2028}", " the",
            "Hello",
        ] {
            bytes.push(piece.as_bytes().to_vec());
        }
        let n_vocab = bytes.len();
        GrammarVocab {
            compiler: gds_runtime::GrammarCompiler::new(bytes, &t, n_vocab)
                .expect("the vocabulary indexes"),
            n_vocab,
            eog: t.eog_ids().to_vec(),
        }
    })
}

/// A model directory holding `tokenizer.json` and, when given, `tokenizer_config.json`, with a
/// manifest listing them (length and BLAKE3, as `gdsconv convert` writes it): the runtime
/// reads only files the manifest lists and checks them first. (The architecture is one the
/// runtime does not run, so that the manifest needs no hyperparameters or layers.)
fn tokenizer_dir(tokenizer_json: &[u8], tokenizer_config_json: Option<&[u8]>) -> tempfile::TempDir {
    use gds_format::file_role;
    let dir = scratch();
    let mut b = gds_format::ManifestBuilder::new();
    b.kv_str("general.architecture", "mamba");
    let files = [
        ("tokenizer.json", file_role::TOKENIZER, Some(tokenizer_json)),
        (
            "tokenizer_config.json",
            file_role::TOKENIZER_CONFIG,
            tokenizer_config_json,
        ),
    ];
    for (name, role, bytes) in files {
        if let Some(bytes) = bytes {
            put(dir.path(), name, bytes);
            b.add_file(
                name,
                role,
                bytes.len() as u64,
                *blake3::hash(bytes).as_bytes(),
            );
        }
    }
    put(dir.path(), gds_format::MANIFEST_FILE, &b.finish());
    dir
}

/// What the converter promises about a model it read: every tensor's bytes lie inside its
/// file and match its dtype and shape. (That a tokenizer it built loads is checked by the
/// `tokenizer` target, on the same exporter: here it would triple the cost of every run.)
fn check_source(src: &gds_convert::source::Source) {
    for t in &src.tensors {
        let n = t.bytes().len() as u64;
        assert_eq!(n, t.nbytes, "{}: slice length differs from nbytes", t.name);
        assert_eq!(
            t.dtype.tensor_bytes(&t.shape),
            Some(t.nbytes),
            "{}: nbytes does not match dtype {} and shape {:?}",
            t.name,
            t.dtype,
            t.shape
        );
    }
    let _ = (src.metadata.len(), src.warnings.len());
}

/// A `tokenizer.json` the converter built is written without being loaded again, so it must
/// load; the pair must also be what `gdsrun` can read.
fn check_export(tokenizer_json: &str, tokenizer_config_json: &str) {
    let t = tokenizers::Tokenizer::from_str(tokenizer_json)
        .unwrap_or_else(|e| panic!("the exported tokenizer.json does not load: {e}"));
    let _ = t.encode("Hello, world! <|im_start|> 123", true);
    let _: Value = serde_json::from_str(tokenizer_config_json)
        .unwrap_or_else(|e| panic!("the exported tokenizer_config.json is not JSON: {e}"));
    let dir = tokenizer_dir(
        tokenizer_json.as_bytes(),
        Some(tokenizer_config_json.as_bytes()),
    );
    if let Ok(t) = TextTokenizer::load(dir.path(), &model_config(0)) {
        exercise(&t);
    }
}

/// Everything `gdsrun` does with a loaded tokenizer, on a fixed conversation.
fn exercise(t: &TextTokenizer) {
    let msgs = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hi <|im_start|> there"),
        Message::new("assistant", "Hello!"),
        Message::new("user", "Bye \u{e9}\u{1f600}"),
    ];
    if t.has_chat_template() {
        let _ = t.render_chat(&msgs);
        let _ = t.encode_chat(&msgs, 4096);
    }
    for parse_special in [false, true] {
        let _ = t.encode(
            "Hello world <|im_end|> \u{e9}\u{1f600}",
            true,
            parse_special,
        );
    }
    if let Ok(ids) = t.encode("Hello world <|im_end|> \u{e9}\u{1f600}", true, false) {
        let _ = t.decode(&ids);
        let mut s = t.stream();
        for &id in &ids {
            let _ = s.push(id);
            let _ = t.is_eog(id);
        }
        let _ = s.flush();
    }
    let _ = (
        t.eog_ids(),
        t.bos(),
        t.add_bos(),
        t.inner().get_vocab_size(true),
    );
}

/// A SmolLM2-like model config; `mode` bit 1 sets BOS/EOS ids, bit 2 `add_bos`.
fn model_config(mode: u8) -> gds_runtime::Config {
    let ids = mode & 2 != 0;
    gds_runtime::Config {
        arch: "llama".into(),
        n_layers: 1,
        n_embd: 8,
        n_heads: 2,
        n_kv_heads: 1,
        n_ff: 16,
        vocab_size: 16,
        context_length: 64,
        head_dim: 4,
        rope_theta: 10000.0,
        rope_scaling: gds_runtime::RopeScaling::None,
        rope_dims: 4,
        rope_attn_factor: None,
        rope_original_context: None,
        rms_norm_eps: 1e-5,
        tie_embeddings: true,
        bos_token_id: ids.then_some(1),
        eos_token_id: ids.then_some(2),
        add_bos: mode & 4 != 0,
        rope_style: gds_runtime::config::RopeStyle::Norm,
        sliding_window: None,
        sliding_window_pattern: 0,
        rope_theta_local: None,
        attn_scale: 0.5,
        attn_softcap: None,
        final_softcap: None,
        moe: None,
        no_rope_step: None,
    }
}

/// A byte-level BPE `tokenizer.json` with SmolLM2's special tokens and a few merges, for
/// `tokenizer` inputs that bring only a `tokenizer_config.json`.
pub const TINY_TOKENIZER_JSON: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 1, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 2, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
  "post_processor": null,
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
  "model": {
    "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
    "vocab": {
      "<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2,
      "H": 3, "e": 4, "l": 5, "o": 6, "Ġ": 7, "w": 8, "r": 9, "d": 10, "i": 11,
      "He": 12, "ll": 13, "Hell": 14, "Hello": 15, "Ã": 16, "©": 17, "ð": 18, "Ł": 19, "ĺ": 20, "Ģ": 21
    },
    "merges": [["H", "e"], ["l", "l"], ["He", "ll"], ["Hell", "o"]]
  }
}"#;
