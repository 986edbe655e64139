//! Text from input files shown to a person: control characters are escaped,
//! so a row cannot move the cursor, set the terminal's title or hide itself.

use std::borrow::Cow;

/// `text` with every control character (C0, DEL, C1) written as `\x..` or
/// `\u{..}`; borrowed unchanged when there is none.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x80 && c.is_control() => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        // OSC 0 sets an xterm's title; CSI 2J clears the screen.
        let hostile = "bad label `\u{1b}]0;pwned\u{7}` \u{1b}[2J é\u{9b}x\r";
        let shown = printable(hostile);
        assert_eq!(shown, "bad label `\\x1b]0;pwned\\x07` \\x1b[2J é\\u{9b}x\\r");
        assert!(!shown.chars().any(char::is_control));
        assert!(matches!(printable("plain é"), Cow::Borrowed(_)));
    }
}
