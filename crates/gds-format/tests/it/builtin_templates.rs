//! The built-in chat templates (`--chat-template NAME`) render a conversation exactly as
//! llama-server's built-in formats of the same names (fixtures/reference/
//! llama-server-native.json's `templates`: llama-server `--no-jinja --chat-template NAME`,
//! `/apply-template`; scripts/gen_native_goldens.py).

use gds_format::chat_template::{builtin, ChatTemplate, Message, BUILTIN};

#[test]
fn every_builtin_renders_as_llama_server() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/reference/llama-server-native.json"
    );
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("golden file")).unwrap();
    let t = &g["templates"];
    let msgs: Vec<Message> = t["conversation"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    let rendered = t["rendered"].as_object().unwrap();
    assert_eq!(rendered.len(), BUILTIN.len(), "every built-in has a golden");
    for (name, want) in rendered {
        let src = builtin(name).unwrap_or_else(|| panic!("no built-in {name}"));
        let got = ChatTemplate::new(src, "<s>", "</s>")
            .unwrap()
            .render(&msgs, true)
            .unwrap();
        assert_eq!(got, want.as_str().unwrap(), "{name}");
    }
    assert!(builtin("no-such-template").is_none());
}
