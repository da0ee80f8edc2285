//! llama.cpp's GBNF grammars (what `llama-server` takes in a request's `grammar` and
//! `llama-cli --grammar-file` reads), translated to llguidance's Lark syntax, which the
//! constraint engine compiles ([`crate::constraint`]).
//!
//! The syntax is llama.cpp's parser's (`src/llama-grammar.cpp`): rules `name ::= ...`, one per
//! line (a newline ends a rule except inside parentheses and right after `|` or `::=`); names
//! of letters, digits and `-`; `"literals"` and `[character classes]` (`^` negates, `a-z`
//! ranges) with the escapes `\x` `\u` `\U` (2, 4, 8 hex digits), `\t` `\r` `\n` `\\` `\"` `\[`
//! `\]` `\-`; `.` (any character); `( ... )`; `*` `+` `?` `{m}` `{m,}` `{m,n}` after an item;
//! `#` comments; the start rule is `root`. Token references (`<[id]>`, `<token>`, `!<...>`)
//! are refused: they name token ids of one vocabulary.
//!
//! A grammar is untrusted input: the translation is linear in its size, bounded (repetition
//! counts as llama.cpp's, nesting depth), and every error names the line and column.

use std::collections::HashMap;
use std::fmt::Write as _;

/// llama.cpp's cap on a repetition count (`MAX_REPETITION_THRESHOLD`).
const MAX_REPEAT: u64 = 2000;
/// Deepest nesting of parentheses taken (llguidance has its own, lower, limit too).
const MAX_DEPTH: usize = 64;
/// Most items (literals, character classes, `.`, groups, rule references, repetitions) and
/// alternatives in one grammar: llguidance compiles at most 65 535 symbols (beyond, it fails
/// an assertion) and its compile time grows faster than linearly with the grammar (30 000
/// alternatives took 1.5 s, 60 000 took 12 s), so a larger grammar is refused before it is
/// compiled. Real grammars have a few hundred.
pub const MAX_ITEMS: usize = 20_000;

/// Whether `src` is written in GBNF rather than Lark: a line (outside `#` comments) defines a
/// rule with `::=`, which Lark never uses (vLLM tells the two apart the same way).
pub fn is_gbnf(src: &str) -> bool {
    src.lines()
        .any(|l| l.split('#').next().is_some_and(|l| l.contains("::=")))
}

/// Translates a GBNF grammar to llguidance's Lark syntax (`start:` is GBNF's `root`).
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let mut p = Parser {
        s: src.as_bytes(),
        src,
        pos: 0,
        names: HashMap::new(),
        order: Vec::new(),
        defined: Vec::new(),
        depth: 0,
        items: 0,
    };
    let mut rules: Vec<(usize, String)> = Vec::new();
    p.space(true);
    while p.pos < p.s.len() {
        let at = p.pos;
        let name = p.name()?;
        let id = p.symbol(name);
        if p.defined[id] {
            return Err(p.err_at(at, &format!("rule {name:?} is defined twice")));
        }
        p.defined[id] = true;
        p.space(false);
        if !p.s[p.pos..].starts_with(b"::=") {
            return Err(p.err("expecting ::="));
        }
        p.pos += 3;
        p.space(true);
        let body = p.alternates(false)?;
        match p.peek() {
            None => {}
            Some(b'\r') => {
                p.pos += if p.s.get(p.pos + 1) == Some(&b'\n') {
                    2
                } else {
                    1
                }
            }
            Some(b'\n') => p.pos += 1,
            Some(_) => return Err(p.err("expecting a newline or the end")),
        }
        p.space(true);
        rules.push((id, body));
    }
    if let Some(id) = (0..p.order.len()).find(|&i| !p.defined[i]) {
        return Err(format!(
            "GBNF grammar: rule {:?} is used but never defined",
            p.order[id]
        ));
    }
    let Some(&root) = p.names.get("root") else {
        return Err("GBNF grammar: there is no `root` rule (the start of the grammar)".into());
    };
    let mut out = format!("start: {}\n", lark_name(root, "root"));
    for (id, body) in rules {
        let _ = writeln!(out, "{}: {body}", lark_name(id, p.order[id]));
    }
    Ok(out)
}

/// A Lark rule name for GBNF rule `id` (GBNF names may hold `-` and capitals, which Lark
/// rule names may not; the index keeps them apart).
fn lark_name(id: usize, name: &str) -> String {
    let tail: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("r{id}_{tail}")
}

struct Parser<'a> {
    s: &'a [u8],
    src: &'a str,
    pos: usize,
    names: HashMap<&'a str, usize>,
    /// Rule names by id, in order of first mention.
    order: Vec<&'a str>,
    defined: Vec<bool>,
    depth: usize,
    /// Items and alternatives so far ([`MAX_ITEMS`]).
    items: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn err_at(&self, at: usize, what: &str) -> String {
        let before = &self.src[..at.min(self.src.len())];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        format!("GBNF grammar, line {line} column {col}: {what}")
    }

    fn err(&self, what: &str) -> String {
        self.err_at(self.pos, what)
    }

    /// Skips blanks and `#` comments (and newlines when `newline_ok`).
    fn space(&mut self, newline_ok: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' => self.pos += 1,
                b'\r' | b'\n' if newline_ok => self.pos += 1,
                b'#' => {
                    while !matches!(self.peek(), None | Some(b'\r' | b'\n')) {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<&'a str, String> {
        let start = self.pos;
        while matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || c == b'-') {
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.err("expecting a rule name"));
        }
        Ok(&self.src[start..self.pos])
    }

    fn symbol(&mut self, name: &'a str) -> usize {
        if let Some(&id) = self.names.get(name) {
            return id;
        }
        let id = self.order.len();
        self.names.insert(name, id);
        self.order.push(name);
        self.defined.push(false);
        id
    }

    /// Counts one more item or alternative at the cursor against [`MAX_ITEMS`].
    fn count_item(&mut self) -> Result<(), String> {
        self.items += 1;
        if self.items > MAX_ITEMS {
            return Err(self.err(&format!(
                "the grammar has more than {MAX_ITEMS} items (literals, character classes, \
                 rule references, groups and alternatives): too large to compile"
            )));
        }
        Ok(())
    }

    fn alternates(&mut self, nested: bool) -> Result<String, String> {
        let mut out = self.sequence(nested)?;
        while self.peek() == Some(b'|') {
            self.count_item()?;
            self.pos += 1;
            self.space(true);
            out.push_str(" | ");
            out.push_str(&self.sequence(nested)?);
        }
        Ok(out)
    }

    fn sequence(&mut self, nested: bool) -> Result<String, String> {
        let mut items: Vec<String> = Vec::new();
        // whether the last item already carries a repetition (a second one wraps it)
        let mut repeated = false;
        while let Some(c) = self.peek() {
            if matches!(c, b'"' | b'[' | b'.' | b'(' | b'*' | b'+' | b'?' | b'{')
                || c.is_ascii_alphanumeric()
                || c == b'-'
            {
                self.count_item()?;
            }
            let item = match c {
                b'"' => {
                    self.pos += 1;
                    let mut lit = String::new();
                    loop {
                        match self.peek() {
                            None => return Err(self.err("unterminated string")),
                            Some(b'"') => break,
                            Some(_) => lit.push(self.char()?),
                        }
                    }
                    self.pos += 1;
                    if lit.is_empty() {
                        "()".to_string() // the empty sequence
                    } else {
                        serde_json::to_string(&lit).map_err(|e| e.to_string())?
                    }
                }
                b'[' => {
                    self.pos += 1;
                    let mut class = String::from("/[");
                    if self.peek() == Some(b'^') {
                        self.pos += 1;
                        class.push('^');
                    }
                    let mut empty = true;
                    loop {
                        match self.peek() {
                            None => return Err(self.err("unterminated character class")),
                            Some(b']') => break,
                            Some(_) => {}
                        }
                        let lo = self.char()?;
                        let _ = write!(class, "\\x{{{:x}}}", lo as u32);
                        if self.peek() == Some(b'-') && !matches!(self.s.get(self.pos + 1), Some(b']') | None) {
                            self.pos += 1;
                            let hi = self.char()?;
                            if hi < lo {
                                return Err(self.err("character range out of order"));
                            }
                            let _ = write!(class, "-\\x{{{:x}}}", hi as u32);
                        }
                        empty = false;
                    }
                    self.pos += 1;
                    if empty {
                        return Err(self.err("empty character class"));
                    }
                    class.push_str("]/");
                    class
                }
                b'.' => {
                    self.pos += 1;
                    "/(?s:.)/".to_string()
                }
                b'(' => {
                    if self.depth >= MAX_DEPTH {
                        return Err(self.err("parentheses nested too deeply"));
                    }
                    self.pos += 1;
                    self.space(true);
                    self.depth += 1;
                    let inner = self.alternates(true)?;
                    self.depth -= 1;
                    if self.peek() != Some(b')') {
                        return Err(self.err("expecting )"));
                    }
                    self.pos += 1;
                    format!("({inner})")
                }
                b'<' | b'!' => {
                    return Err(self.err(
                        "token references (<[id]>, <token>, !<...>) are not supported: they name token ids of one vocabulary",
                    ))
                }
                b'*' | b'+' | b'?' | b'{' => {
                    let Some(last) = items.pop() else {
                        return Err(self.err("a repetition with nothing before it"));
                    };
                    let op = self.repetition()?;
                    let last = if repeated { format!("({last})") } else { last };
                    repeated = true;
                    // x{0} repeats nothing: the empty sequence
                    items.push(match op {
                        Some(op) => format!("{last}{op}"),
                        None => "()".to_string(),
                    });
                    self.space(nested);
                    continue;
                }
                c if c.is_ascii_alphanumeric() || c == b'-' => {
                    let name = self.name()?;
                    let id = self.symbol(name);
                    lark_name(id, name)
                }
                _ => break,
            };
            repeated = false;
            items.push(item);
            self.space(nested);
        }
        Ok(items.join(" "))
    }

    /// `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}` at the cursor: the Lark suffix, or `None` for a
    /// repetition of nothing (`{0}`, `{0,0}`).
    fn repetition(&mut self) -> Result<Option<String>, String> {
        let c = self.peek().unwrap_or(0);
        self.pos += 1;
        if c != b'{' {
            return Ok(Some((c as char).to_string()));
        }
        self.space(true);
        let min = self.int()?;
        self.space(true);
        let max = match self.peek() {
            Some(b'}') => Some(min),
            Some(b',') => {
                self.pos += 1;
                self.space(true);
                let max = if matches!(self.peek(), Some(c) if c.is_ascii_digit()) {
                    Some(self.int()?)
                } else {
                    None
                };
                self.space(true);
                if self.peek() != Some(b'}') {
                    return Err(self.err("expecting }"));
                }
                max
            }
            _ => return Err(self.err("expecting , or }")),
        };
        self.pos += 1;
        if min > MAX_REPEAT {
            return Err(self.err(&format!("a repetition of {min}: at most {MAX_REPEAT}")));
        }
        // llama.cpp: a maximum over its cap means no maximum
        let max = max.filter(|&m| m <= MAX_REPEAT);
        Ok(match max {
            Some(m) if m < min => {
                return Err(self.err("a repetition's maximum is below its minimum"))
            }
            Some(0) => None,
            Some(m) if m == min => Some(format!("{{{m}}}")),
            Some(m) => Some(format!("{{{min},{m}}}")),
            None => Some(format!("{{{min},}}")),
        })
    }

    fn int(&mut self) -> Result<u64, String> {
        let start = self.pos;
        while matches!(self.peek(), Some(c) if c.is_ascii_digit()) {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(self.err("expecting a number"));
        }
        // more digits than a u64 holds: over any cap
        Ok(self.src[start..self.pos].parse().unwrap_or(u64::MAX))
    }

    /// One character of a literal or class (an escape, or a UTF-8 character).
    fn char(&mut self) -> Result<char, String> {
        let at = self.pos;
        if self.peek() == Some(b'\\') {
            let e = self.s.get(self.pos + 1).copied();
            self.pos += 2;
            let hex = |p: &mut Self, n: usize| -> Result<char, String> {
                let digits = p
                    .src
                    .get(p.pos..p.pos + n)
                    .filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()));
                let Some(d) = digits else {
                    return Err(p.err_at(at, &format!("expecting {n} hex digits")));
                };
                p.pos += n;
                let v = u32::from_str_radix(d, 16).map_err(|e| e.to_string())?;
                char::from_u32(v)
                    .ok_or_else(|| p.err_at(at, &format!("\\{v:x} is not a character")))
            };
            return match e {
                Some(b'x') => hex(self, 2),
                Some(b'u') => hex(self, 4),
                Some(b'U') => hex(self, 8),
                Some(b't') => Ok('\t'),
                Some(b'r') => Ok('\r'),
                Some(b'n') => Ok('\n'),
                Some(c @ (b'\\' | b'"' | b'[' | b']' | b'-')) => Ok(c as char),
                _ => Err(self.err_at(at, "unknown escape")),
            };
        }
        let c = self.src[self.pos..]
            .chars()
            .next()
            .ok_or_else(|| self.err("unexpected end"))?;
        self.pos += c.len_utf8();
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::{gbnf_to_lark, is_gbnf};

    #[test]
    fn rules_literals_classes_and_repetitions_translate() {
        let g = "root ::= \"a\"{5,5} item-list  # five a's, then items\n\
                 item-list ::= ( [a-z0-9] | \"\\x41\\n\" )+ [^\\]\"]? .*\n";
        let l = gbnf_to_lark(g).unwrap();
        assert_eq!(
            l,
            "start: r0_root\n\
             r0_root: \"a\"{5} r1_item_list\n\
             r1_item_list: (/[\\x{61}-\\x{7a}\\x{30}-\\x{39}]/ | \"A\\n\")+ /[^\\x{5d}\\x{22}]/? /(?s:.)/*\n"
        );
    }

    #[test]
    fn newlines_end_rules_except_after_a_bar_and_inside_parentheses() {
        let g = "root ::= a |\n  b\na ::= (\"x\"\n \"y\")\nb ::= \"z\"";
        let l = gbnf_to_lark(g).unwrap();
        assert!(l.contains("r0_root: r1_a | r2_b\n"), "{l}");
        assert!(l.contains("r1_a: (\"x\" \"y\")\n"), "{l}");
        // a newline inside a top-level sequence ends the rule: the next line is not a rule
        let e = gbnf_to_lark("root ::= \"x\"\n  \"y\"").unwrap_err();
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn repetition_forms_and_caps() {
        let one = |g: &str| {
            gbnf_to_lark(&format!("root ::= \"a\"{g}"))
                .map(|l| l.lines().nth(1).unwrap().to_string())
        };
        assert_eq!(one("{2,}").unwrap(), "r0_root: \"a\"{2,}");
        assert_eq!(one("{2,4}").unwrap(), "r0_root: \"a\"{2,4}");
        assert_eq!(one("{0}").unwrap(), "r0_root: ()");
        assert_eq!(one("*?").unwrap(), "r0_root: (\"a\"*)?");
        // over llama.cpp's cap: a minimum is refused, a maximum dropped
        assert!(one("{2001}").unwrap_err().contains("at most 2000"));
        assert_eq!(one("{1,99999}").unwrap(), "r0_root: \"a\"{1,}");
        assert!(one("{3,2}").unwrap_err().contains("below its minimum"));
        assert!(one("{99999999999999999999999}").is_err());
    }

    #[test]
    fn bad_grammars_are_errors_naming_the_place() {
        for (g, what) in [
            ("root ::= \"abc", "unterminated string"),
            ("root ::= [abc", "unterminated character class"),
            ("root ::= []", "empty character class"),
            ("root ::= [z-a]", "out of order"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= \"\\x4\"", "hex digits"),
            ("root ::= \"\\uD800\"", "not a character"),
            ("root ::= (\"a\"", "expecting )"),
            ("root ::= * \"a\"", "nothing before it"),
            ("root ::= other", "never defined"),
            ("start ::= \"a\"", "no `root` rule"),
            ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
            ("root := \"a\"", "expecting ::="),
            ("root ::= <[12]>", "token references"),
            ("root ::= \"a\" ) ", "expecting a newline"),
            ("::= \"a\"", "rule name"),
        ] {
            let e = gbnf_to_lark(g).unwrap_err();
            assert!(e.contains(what) && e.contains("GBNF grammar"), "{g:?}: {e}");
        }
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(100), ")".repeat(100));
        assert!(gbnf_to_lark(&deep)
            .unwrap_err()
            .contains("nested too deeply"));
    }

    #[test]
    fn a_grammar_too_large_to_compile_is_refused_at_once() {
        // 100 000 alternatives (1 MB): llguidance took 17 s and then failed an assertion
        let alts: Vec<String> = (0..100_000).map(|i| format!("\"w{i}\"")).collect();
        let t = std::time::Instant::now();
        let e = gbnf_to_lark(&format!("root ::= {}", alts.join(" | "))).unwrap_err();
        assert!(
            e.contains("more than 20000 items") && e.contains("line 1"),
            "{e}"
        );
        assert!(t.elapsed().as_secs() < 5);
        // many rules of a few items each count as well
        let rules: String = (0..7000)
            .map(|i| format!("r{i} ::= \"a\" [b-c] r{}\n", i + 1))
            .collect();
        let e = gbnf_to_lark(&format!("root ::= r0\n{rules}r7000 ::= \"z\"")).unwrap_err();
        assert!(e.contains("too large"), "{e}");
        // under the bound: translated
        let alts: Vec<String> = (0..5000).map(|i| format!("\"w{i}\"")).collect();
        assert!(gbnf_to_lark(&format!("root ::= {}", alts.join(" | "))).is_ok());
    }

    #[test]
    fn gbnf_is_told_from_lark_by_its_rule_sign() {
        assert!(is_gbnf("root ::= \"a\""));
        assert!(is_gbnf("# a comment ::= not this\nroot ::= x"));
        assert!(!is_gbnf("start: \"a\" # root ::= in a comment"));
        assert!(!is_gbnf("start: NUM\nNUM: /[0-9]+/"));
    }

    #[test]
    fn any_input_gives_a_grammar_or_an_error_never_a_panic() {
        // every prefix of grammars with every construct, and some noise: no panic
        let g = "root ::= \"a\\u00e9\\U0001F600\"{1,3} [^\\x00-\\x1f] (x | \"\" )* .\nx ::= \"é\" # c\n";
        for end in 0..=g.len() {
            if g.is_char_boundary(end) {
                let _ = gbnf_to_lark(&g[..end]);
            }
        }
        for noise in [
            "\u{0}",
            "\\",
            "[",
            "{",
            "{,}",
            "\"\\",
            "root ::= \"a\"{",
            "root ::= \"a\"{1,",
        ] {
            let _ = gbnf_to_lark(noise);
        }
    }
}
