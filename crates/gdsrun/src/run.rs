//! `gdsrun run`: one prompt, or an interactive chat that keeps the KV cache between turns.

use crate::cli::{CommonArgs, RunArgs};
use crate::out::{self, err, errln, outln};
use anyhow::Result;
use gds_runtime::{Engine, Grammar, KvDtype, Plan, PlanOptions, RuntimeError};
use std::cell::RefCell;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Plan options from the flags every subcommand shares.
pub fn common_options(c: &CommonArgs) -> PlanOptions {
    PlanOptions {
        model_dir: c.model_dir.clone(),
        threads: c.threads,
        batch: c.batch,
        kv_dtype: c.kv_type.as_deref().and_then(KvDtype::parse),
        backend: c.backend.clone(),
        io: c.io.clone(),
        mem_budget: c.mem_budget,
        vram_budget: c.vram_budget,
        activations: c.activations.clone(),
        no_verify: c.no_verify,
        isa: c.isa,
        gemm_min_tokens: c.gemm_min_tokens.map(|n| n as usize),
        cuda_graphs: c.cuda_graphs.as_deref().map(|g| g == "on"),
        gemm_type: c.gemm_type,
        ..Default::default()
    }
}

/// The warning for the CUDA backend's flags given to a run on the CPU backend (where they
/// do nothing), if any was: `(given, flag)` pairs.
pub fn cuda_only_warning(flags: &[(bool, &str)]) -> Option<String> {
    let given: Vec<&str> = flags.iter().filter(|f| f.0).map(|f| f.1).collect();
    match given.as_slice() {
        [] => None,
        [one] => Some(format!(
            "{one} applies to the CUDA backend only; ignored on the CPU backend"
        )),
        many => Some(format!(
            "{} apply to the CUDA backend only; ignored on the CPU backend",
            many.join(", ")
        )),
    }
}

/// Warns once on stderr when `plan` runs on the CPU and `c` gave flags of the CUDA backend.
pub fn warn_cuda_only(c: &CommonArgs, plan: &Plan) {
    if plan.backend != gds_runtime::backend::Backend::Cpu {
        return;
    }
    if let Some(w) = cuda_only_warning(&[
        (c.gemm_type.is_some(), "--gemm-type"),
        (c.cuda_graphs.is_some(), "--cuda-graphs"),
        (c.gemm_min_tokens.is_some(), "--gemm-min-tokens"),
    ]) {
        errln!("gdsrun: warning: {w}");
    }
}

/// The warning for chat flags given with `--raw` (which applies no chat template), if any.
fn raw_warning(a: &RunArgs) -> Option<String> {
    if !a.raw {
        return None;
    }
    let given: Vec<&str> = [
        (a.chat_template.is_some(), "--chat-template"),
        (a.chat_template_file.is_some(), "--chat-template-file"),
        (a.system.is_some(), "--system"),
    ]
    .iter()
    .filter(|f| f.0)
    .map(|f| f.1)
    .collect();
    (!given.is_empty()).then(|| {
        format!(
            "{} ignored: --raw applies no chat template",
            given.join(", ")
        )
    })
}

fn plan_options(a: &RunArgs) -> PlanOptions {
    a.sampling.options(PlanOptions {
        ctx: a.ctx,
        max_tokens: a.max_tokens,
        stop: a.stop.clone(),
        max_joules: a.max_joules,
        raw: a.raw,
        parse_special: a.parse_special,
        system: a.system.clone(),
        chat_template_file: a.chat_template_file.clone(),
        chat_template: a.chat_template.clone(),
        draft: a.draft.clone(),
        draft_model: a.draft_model.clone(),
        draft_max: a.draft_max,
        draft_gate: a.draft_gate.as_deref().map(|g| g == "on"),
        ..common_options(&a.common)
    })
}

/// A grammar from the command line, with the flag (and file or expression) that gave it,
/// for its compile errors.
struct GivenGrammar {
    grammar: Grammar,
    /// `--grammar FILE`, `--json-schema FILE`, `--regex "RX"`.
    flag: String,
}

impl GivenGrammar {
    /// The error for `msg`, the runtime's "… does not compile: …" (which says GBNF for a
    /// GBNF file), naming the flag (and the file).
    fn error(&self, msg: &str) -> RuntimeError {
        RuntimeError::Usage(format!("{}: {msg}", self.flag))
    }
}

/// The grammar of `--json-schema FILE`, `--grammar FILE` (Lark, or llama.cpp's GBNF) or
/// `--regex RX`. Unreadable files
/// and a schema file that is not JSON are usage errors naming the file; whether the
/// grammar compiles is checked when the model is loaded.
fn grammar_option(a: &RunArgs) -> Result<Option<GivenGrammar>, RuntimeError> {
    let read = |p: &std::path::Path| {
        gds_runtime::plan::read_user_file(p).map_err(|e| RuntimeError::file(p, e))
    };
    if let Some(p) = &a.json_schema {
        let schema = serde_json::from_str(&read(p)?).map_err(|e| {
            RuntimeError::Usage(format!("--json-schema {}: not JSON: {e}", p.display()))
        })?;
        return Ok(Some(GivenGrammar {
            grammar: Grammar::JsonSchema(schema),
            flag: format!("--json-schema {}", p.display()),
        }));
    }
    if let Some(p) = &a.grammar {
        let text = read(p)?;
        let g = Grammar::from_text(&text)
            .map_err(|e| RuntimeError::Usage(format!("--grammar {}: {e}", p.display())))?;
        return Ok(Some(GivenGrammar {
            grammar: g,
            flag: format!("--grammar {}", p.display()),
        }));
    }
    Ok(a.regex.as_ref().map(|rx| GivenGrammar {
        grammar: Grammar::Regex(rx.clone()),
        flag: format!("--regex {rx:?}"),
    }))
}

/// Ctrl-C: during generation it stops the reply (metrics are still reported); otherwise,
/// or when pressed twice, it exits.
fn install_ctrlc(interrupt: Arc<AtomicBool>, generating: Arc<AtomicBool>) {
    let r = ctrlc::set_handler(move || {
        if generating.load(Ordering::SeqCst) && !interrupt.swap(true, Ordering::SeqCst) {
            return;
        }
        std::process::exit(130);
    });
    if let Err(e) = r {
        errln!("gdsrun: warning: Ctrl-C handler not installed: {e}");
    }
}

/// Writes generated text to stdout as it comes. A failed write (a closed pipe) interrupts
/// the generation; [`Printer::check`] then ends the command with the error.
struct Printer {
    failed: RefCell<Option<std::io::Error>>,
    interrupt: Arc<AtomicBool>,
}

impl Printer {
    fn print(&self, s: &str) {
        if self.failed.borrow().is_some() {
            return;
        }
        let mut out = std::io::stdout().lock();
        if let Err(e) = out.write_all(s.as_bytes()).and_then(|()| out.flush()) {
            *self.failed.borrow_mut() = Some(e);
            self.interrupt.store(true, Ordering::Relaxed);
        }
    }

    /// The write error, if a write failed ([`out::Closed`] for a closed pipe).
    fn check(&self) -> Result<()> {
        match self.failed.borrow_mut().take() {
            Some(e) => Err(out::stdout_error(e)),
            None => Ok(()),
        }
    }
}

/// Runs the command.
pub fn run(a: RunArgs) -> Result<()> {
    let given = grammar_option(&a)?;
    let plan = Plan::build(&PlanOptions {
        grammar: given.as_ref().map(|g| g.grammar.clone()),
        logprobs: a.logprobs.map(usize::from),
        ..plan_options(&a)
    })?;
    if a.plan {
        return outln!("{}", plan.to_json());
    }
    warn_cuda_only(&a.common, &plan);
    if let Some(w) = raw_warning(&a) {
        errln!("gdsrun: warning: {w}");
    }
    for i in plan.recommended_sampling.iter().flat_map(|r| &r.ignored) {
        errln!("gdsrun: warning: left out of the model's recommended sampling: {i}");
    }
    let mut engine = match Engine::load(plan) {
        Ok(e) => e,
        // the user's grammar, not the model: named by its flag
        Err(RuntimeError::Grammar(m)) if m.contains(" does not compile: ") => {
            return Err(match &given {
                Some(g) => g.error(&m),
                None => RuntimeError::Grammar(m),
            }
            .into())
        }
        Err(e) => {
            return Err(
                anyhow::Error::from(e).context(format!("loading {}", a.common.model_dir.display()))
            )
        }
    };
    if let (Some(j), Some(why)) = (a.max_joules, engine.energy_unavailable()) {
        errln!("gdsrun: warning: --max-joules {j} cannot be enforced: no energy counter ({why})");
    }
    let generating = Arc::new(AtomicBool::new(false));
    let interrupt = engine.interrupt_flag();
    install_ctrlc(interrupt.clone(), generating.clone());
    let printer = Printer {
        failed: RefCell::new(None),
        interrupt: interrupt.clone(),
    };

    let turn = |engine: &mut Engine, prompt: &str| -> Result<()> {
        generating.store(true, Ordering::SeqCst);
        let out = if a.json {
            engine.generate(prompt, &mut |_| {})
        } else {
            // a thinking model's reasoning: dimmed before the answer on a terminal, left out
            // of a pipe (`--json` has it apart)
            let tty = std::io::stdout().is_terminal();
            let thinking = std::cell::Cell::new(false);
            let out = engine.generate_parts(
                prompt,
                &mut |s| {
                    if tty {
                        if !thinking.replace(true) {
                            printer.print("\x1b[2m");
                        }
                        printer.print(s);
                    }
                },
                &mut |s| {
                    if thinking.replace(false) {
                        printer.print("\x1b[0m\n");
                    }
                    printer.print(s)
                },
            );
            if thinking.get() {
                printer.print("\x1b[0m");
            }
            out
        };
        generating.store(false, Ordering::SeqCst);
        printer.check()?;
        let out = out?;
        if a.json {
            outln!("{}", out.json_with_plan(engine.plan()))?;
        } else {
            printer.print("\n");
            printer.check()?;
            errln!("[{}] {}", out.stop_reason.as_str(), out.metrics.summary());
        }
        Ok(())
    };

    match &a.prompt {
        Some(p) => turn(&mut engine, p),
        None => {
            let stdin = std::io::stdin();
            let interactive = stdin.is_terminal();
            if interactive {
                errln!(
                    "gdsrun: {} mode; one message per line, /reset to forget, Ctrl-D to quit",
                    if engine.plan().mode == gds_runtime::plan::Mode::Chat {
                        "chat"
                    } else {
                        "raw completion"
                    }
                );
            }
            // a conversation that outgrows the context forgets its oldest messages (the
            // system prompt stays), as Ollama's chat does, rather than refusing every turn
            engine.set_drop_oldest(true);
            let mut lines = stdin.lock();
            loop {
                if interactive {
                    err!("> ");
                }
                let mut line = String::new();
                if lines
                    .read_line(&mut line)
                    .map_err(|e| RuntimeError::file("stdin", e))?
                    == 0
                {
                    return Ok(());
                }
                let msg = line.trim_end_matches(['\n', '\r']);
                if msg.trim().is_empty() {
                    continue;
                }
                if msg.trim() == "/reset" {
                    engine.reset_chat();
                    continue;
                }
                let forgotten = engine.dropped_messages();
                let r = turn(&mut engine, msg);
                let n = engine.dropped_messages() - forgotten;
                if n > 0 {
                    errln!(
                        "gdsrun: the conversation outgrew the context ({} tokens): its {n} oldest messages were forgotten",
                        engine.plan().ctx
                    );
                }
                match r {
                    // a turn that does not fit is reported; the chat goes on
                    Err(e)
                        if matches!(
                            e.downcast_ref::<RuntimeError>(),
                            Some(
                                RuntimeError::PromptTooLong { .. }
                                    | RuntimeError::TextTooLong { .. }
                            )
                        ) =>
                    {
                        errln!("gdsrun: error: {e:#} (/reset to start over)")
                    }
                    r => r?,
                }
            }
        }
    }
}
