package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"
)

// The vocabulary and merges are most of a tokenizer.json (a Llama 3 file
// holds 128k entries and 280k merges). jsonReader reads those two shapes
// directly, without reflection; strings holding escapes or bytes that are
// not valid UTF-8 are handed to encoding/json, so every string reads as the
// standard library reads it.
type jsonReader struct {
	data []byte
	pos  int
}

func (r *jsonReader) errorf(format string, args ...any) error {
	return fmt.Errorf("offset %d: %s", r.pos, fmt.Sprintf(format, args...))
}

func (r *jsonReader) skipSpace() {
	for r.pos < len(r.data) {
		switch r.data[r.pos] {
		case ' ', '\t', '\n', '\r':
			r.pos++
		default:
			return
		}
	}
}

// peek returns the next non-space byte, or 0 at the end (a 0 byte in the
// data is never valid where peek is used).
func (r *jsonReader) peek() byte {
	r.skipSpace()
	if r.pos >= len(r.data) {
		return 0
	}
	return r.data[r.pos]
}

func (r *jsonReader) expect(c byte) error {
	if r.peek() != c {
		return r.errorf("want %q", c)
	}
	r.pos++
	return nil
}

// end checks that nothing but space follows.
func (r *jsonReader) end() error {
	if r.skipSpace(); r.pos < len(r.data) {
		return r.errorf("unexpected data after value")
	}
	return nil
}

func (r *jsonReader) readString() (string, error) {
	if r.peek() != '"' {
		return "", r.errorf("want a string")
	}
	start := r.pos
	escaped, ascii := false, true
	i := start + 1
	for ; i < len(r.data); i++ {
		c := r.data[i]
		if c == '"' {
			break
		}
		if c == '\\' {
			escaped = true
			i++
			continue
		}
		if c < 0x20 {
			return "", r.errorf("control character in string")
		}
		if c >= utf8.RuneSelf {
			ascii = false
		}
	}
	if i >= len(r.data) {
		return "", r.errorf("unterminated string")
	}
	r.pos = i + 1
	raw := r.data[start+1 : i]
	if !escaped && (ascii || utf8.Valid(raw)) {
		return string(raw), nil
	}
	var s string
	if err := json.Unmarshal(r.data[start:r.pos], &s); err != nil {
		r.pos = start
		return "", r.errorf("%v", err)
	}
	return s, nil
}

// readInt32 reads an integer in JSON syntax that fits in an int32.
func (r *jsonReader) readInt32() (int32, error) {
	r.skipSpace()
	start := r.pos
	neg := false
	if r.pos < len(r.data) && r.data[r.pos] == '-' {
		neg = true
		r.pos++
	}
	digits := r.pos
	var v int64
	for r.pos < len(r.data) && r.data[r.pos] >= '0' && r.data[r.pos] <= '9' {
		v = v*10 + int64(r.data[r.pos]-'0')
		if v > 1<<31 {
			r.pos = start
			return 0, r.errorf("integer out of range")
		}
		r.pos++
	}
	n := r.pos - digits
	if n == 0 || (n > 1 && r.data[digits] == '0') {
		r.pos = start
		return 0, r.errorf("want an integer")
	}
	if r.pos < len(r.data) {
		if c := r.data[r.pos]; c == '.' || c == 'e' || c == 'E' {
			r.pos = start
			return 0, r.errorf("want an integer")
		}
	}
	if neg {
		v = -v
	}
	if v > 1<<31-1 {
		r.pos = start
		return 0, r.errorf("integer out of range")
	}
	return int32(v), nil
}

// readVocab reads a JSON object mapping token strings to ids. A key given
// twice keeps its last id, as encoding/json does.
func readVocab(data []byte) (map[string]int32, error) {
	r := &jsonReader{data: data}
	if err := r.expect('{'); err != nil {
		return nil, err
	}
	vocab := make(map[string]int32, len(data)/16)
	if r.peek() == '}' {
		r.pos++
		return vocab, r.end()
	}
	for {
		k, err := r.readString()
		if err != nil {
			return nil, err
		}
		if err := r.expect(':'); err != nil {
			return nil, err
		}
		v, err := r.readInt32()
		if err != nil {
			return nil, fmt.Errorf("token %q: %w", k, err)
		}
		vocab[k] = v
		switch r.peek() {
		case ',':
			r.pos++
		case '}':
			r.pos++
			return vocab, r.end()
		default:
			return nil, r.errorf("want ',' or '}'")
		}
	}
}

// readMerges reads a JSON array of merges, each "left right" or
// ["left", "right"].
func readMerges(data []byte) ([][2]string, error) {
	r := &jsonReader{data: data}
	if err := r.expect('['); err != nil {
		return nil, err
	}
	merges := make([][2]string, 0, len(data)/12)
	if r.peek() == ']' {
		r.pos++
		return merges, r.end()
	}
	for {
		var m [2]string
		switch r.peek() {
		case '"':
			s, err := r.readString()
			if err != nil {
				return nil, err
			}
			left, right, ok := strings.Cut(s, " ")
			if !ok || strings.Contains(right, " ") {
				return nil, fmt.Errorf("merge %d %q: not two tokens separated by one space", len(merges), s)
			}
			m = [2]string{left, right}
		case '[':
			r.pos++
			var err error
			if m[0], err = r.readString(); err != nil {
				return nil, err
			}
			if err := r.expect(','); err != nil {
				return nil, err
			}
			if m[1], err = r.readString(); err != nil {
				return nil, err
			}
			if err := r.expect(']'); err != nil {
				return nil, fmt.Errorf("merge %d: %w (a merge has two parts)", len(merges), err)
			}
		default:
			return nil, r.errorf("merge %d: want a string or a pair", len(merges))
		}
		merges = append(merges, m)
		switch r.peek() {
		case ',':
			r.pos++
		case ']':
			r.pos++
			return merges, r.end()
		default:
			return nil, r.errorf("want ',' or ']'")
		}
	}
}

// skipValue moves past one JSON value of any kind and returns its bytes,
// checked with json.Valid.
func (r *jsonReader) skipValue() ([]byte, error) {
	start := r.pos
	if _, err := r.rawValue(); err != nil {
		return nil, err
	}
	return r.valid(start)
}

// rawValue moves past one JSON value and returns its bytes, checking only
// that brackets balance: the caller must parse the bytes fully.
func (r *jsonReader) rawValue() ([]byte, error) {
	r.skipSpace()
	start := r.pos
	depth := 0
	for r.pos < len(r.data) {
		switch c := r.data[r.pos]; c {
		case '"':
			if _, err := r.skipString(); err != nil {
				return nil, err
			}
			if depth == 0 {
				return r.data[start:r.pos], nil
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return r.data[start:r.pos], nil
			}
			depth--
			if depth == 0 {
				r.pos++
				return r.data[start:r.pos], nil
			}
		case ',', ':', ' ', '\t', '\n', '\r':
			if depth == 0 {
				return r.data[start:r.pos], nil
			}
		}
		r.pos++
	}
	if depth != 0 {
		return nil, r.errorf("unterminated value")
	}
	return r.data[start:r.pos], nil
}

func (r *jsonReader) valid(start int) ([]byte, error) {
	raw := r.data[start:r.pos]
	if !json.Valid(raw) {
		r.pos = start
		return nil, r.errorf("invalid JSON value")
	}
	return raw, nil
}

// skipString moves past a string without decoding it.
func (r *jsonReader) skipString() ([]byte, error) {
	start := r.pos
	for i := start + 1; i < len(r.data); i++ {
		switch r.data[i] {
		case '\\':
			i++
		case '"':
			r.pos = i + 1
			return r.data[start:r.pos], nil
		}
	}
	return nil, r.errorf("unterminated string")
}

// readObject reads a JSON object, calling field for each key with the
// reader placed on the value, which field must consume. The whole object
// is the whole input.
func (r *jsonReader) readObject(field func(key string) error) error {
	if err := r.expect('{'); err != nil {
		return err
	}
	if r.peek() == '}' {
		r.pos++
		return r.end()
	}
	for {
		k, err := r.readString()
		if err != nil {
			return err
		}
		if err := r.expect(':'); err != nil {
			return err
		}
		if err := field(k); err != nil {
			return err
		}
		switch r.peek() {
		case ',':
			r.pos++
		case '}':
			r.pos++
			return r.end()
		default:
			return r.errorf("want ',' or '}'")
		}
	}
}
