//! Canonical JSON: object keys sorted, no whitespace. Manifests and configs are written this
//! way so that the same model always gives the same bytes and so the same digest.

use serde_json::Value;

/// `v` as canonical JSON bytes.
pub fn canonical(v: &Value) -> Vec<u8> {
    let mut out = String::new();
    write(v, &mut out);
    out.into_bytes()
}

fn write(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_sorted_at_every_level() {
        let v: Value =
            serde_json::from_str(r#"{"b":1,"a":{"z":[{"y":1,"x":"\"q"}],"c":null}}"#).unwrap();
        assert_eq!(
            String::from_utf8(canonical(&v)).unwrap(),
            r#"{"a":{"c":null,"z":[{"x":"\"q","y":1}]},"b":1}"#
        );
    }
}
