//! Panics of libraries that run untrusted input (minijinja on a chat template, the
//! `tokenizers` crate on a tokenizer), caught and turned into errors without the panic hook
//! printing them: the message and backtrace note on stderr would only repeat the error, and
//! read as a crash.

use std::cell::Cell;

thread_local! {
    /// Set while [`catch`] runs `f` on this thread.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Installs (once) a panic hook that says nothing for a panic inside [`catch`] and passes
/// every other panic to the hook there was before.
fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.try_with(Cell::get).unwrap_or(false) {
                previous(info);
            }
        }));
    });
}

/// Runs `f`, returning its panic's message instead of unwinding further; the panic is not
/// printed. (Nested calls keep the outer one quiet.)
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    install();
    let was = QUIET.with(|q| q.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    r.map_err(|p| message(&*p).to_string())
}

/// A panic's message.
fn message(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_caught_panic_is_its_message() {
        assert_eq!(super::catch(|| 7), Ok(7));
        let r: Result<(), String> = super::catch(|| panic!("boom {}", 1));
        assert_eq!(r, Err("boom 1".to_string()));
        let r: Result<(), String> = super::catch(|| std::panic::panic_any(3u8));
        assert_eq!(r, Err("(no message)".to_string()));
        // nested: the inner one's end leaves the outer one quiet
        let r = super::catch(|| {
            let _ = super::catch(|| panic!("inner"));
            panic!("outer")
        });
        assert_eq!(r, Err::<(), _>("outer".to_string()));
    }
}
