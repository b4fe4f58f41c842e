package chat

import "strings"

// tojsonName is the name under which Hugging Face's tojson is handed to the
// engine. The engine's own tojson differs from Python's json.dumps (with an
// indent it sorts keys and escapes <, > and &), and a template variable
// cannot replace a built-in filter, so prepare renames the template's uses
// of the filter to this name, which the engine finds among the variables.
const tojsonName = "__tandem_tojson"

// prepare turns template source into what the engine compiles, as Jinja
// reads it: "\r\n" and "\r" become "\n" and one trailing newline is dropped
// (keep_trailing_newline is off); uses of the tojson filter are renamed to
// tojsonName.
func prepare(src string) string {
	src = strings.ReplaceAll(src, "\r\n", "\n")
	src = strings.ReplaceAll(src, "\r", "\n")
	src = strings.TrimSuffix(src, "\n")
	return renameFilter(src, "tojson", tojsonName)
}

// renameFilter renames the filter from to "to" wherever a tag applies it
// ("| from" followed by a character that cannot continue a name), outside
// string literals and comments.
func renameFilter(src, from, to string) string {
	var b strings.Builder
	i, last := 0, 0
	for i < len(src) {
		if !strings.HasPrefix(src[i:], "{{") && !strings.HasPrefix(src[i:], "{%") && !strings.HasPrefix(src[i:], "{#") {
			i++
			continue
		}
		if src[i+1] == '#' {
			end := strings.Index(src[i+2:], "#}")
			if end < 0 {
				break
			}
			i += end + 4
			continue
		}
		closer := "}}"
		if src[i+1] == '%' {
			closer = "%}"
		}
		i += 2
		for i < len(src) && !strings.HasPrefix(src[i:], closer) {
			switch c := src[i]; c {
			case '\'', '"':
				i++
				for i < len(src) && src[i] != c {
					if src[i] == '\\' {
						i++
					}
					i++
				}
				i++
			case '|':
				j := i + 1
				for j < len(src) && (src[j] == ' ' || src[j] == '\t' || src[j] == '\n') {
					j++
				}
				if strings.HasPrefix(src[j:], from) && (j+len(from) == len(src) || !isNameByte(src[j+len(from)])) {
					b.WriteString(src[last:j])
					b.WriteString(to)
					last = j + len(from)
					j = last
				}
				i = j
			default:
				i++
			}
		}
		i += len(closer)
	}
	b.WriteString(src[min(last, len(src)):])
	return b.String()
}

func isNameByte(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}
