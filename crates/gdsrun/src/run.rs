//! `gdsrun run`: one prompt, or an interactive chat that keeps the KV cache between turns.

use crate::cli::{CommonArgs, RunArgs};
use crate::out::{self, err, errln, outln};
use anyhow::{Context, Result};
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

/// The grammar of `--json-schema FILE`, `--grammar FILE` (Lark, or llama.cpp's GBNF) or
/// `--regex RX`. Unreadable files
/// and a schema file that is not JSON are usage errors naming the file; whether the
/// grammar compiles is checked when the model is loaded.
fn grammar_option(a: &RunArgs) -> Result<Option<Grammar>, RuntimeError> {
    let read =
        |p: &std::path::Path| std::fs::read_to_string(p).map_err(|e| RuntimeError::file(p, e));
    if let Some(p) = &a.json_schema {
        let schema = serde_json::from_str(&read(p)?).map_err(|e| {
            RuntimeError::Usage(format!("--json-schema {}: not JSON: {e}", p.display()))
        })?;
        return Ok(Some(Grammar::JsonSchema(schema)));
    }
    if let Some(p) = &a.grammar {
        let g = Grammar::from_text(&read(p)?)
            .map_err(|e| RuntimeError::Usage(format!("--grammar {}: {e}", p.display())))?;
        return Ok(Some(g));
    }
    Ok(a.regex.clone().map(Grammar::Regex))
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
    let plan = Plan::build(&PlanOptions {
        grammar: grammar_option(&a)?,
        logprobs: a.logprobs.map(usize::from),
        ..plan_options(&a)
    })?;
    if a.plan {
        return outln!("{}", plan.to_json());
    }
    let mut engine =
        Engine::load(plan).with_context(|| format!("loading {}", a.common.model_dir.display()))?;
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
                match turn(&mut engine, msg) {
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
