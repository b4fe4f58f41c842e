package membership

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
)

func TestParseLine(t *testing.T) {
	tests := []struct {
		line  string
		level slog.Level
		msg   string
	}{
		{"[DEBUG] memberlist: Stream connection from=127.0.0.1:5\n", slog.LevelDebug, "Stream connection from=127.0.0.1:5"},
		{"[INFO] memberlist: Suspect n3 has failed\n", slog.LevelInfo, "Suspect n3 has failed"},
		{"[WARN] memberlist: Refuting a dead message\n", slog.LevelWarn, "Refuting a dead message"},
		{"[ERR] memberlist: Failed fallback TCP ping\n", slog.LevelError, "Failed fallback TCP ping"},
		{"[ERROR] memberlist: x\r\n", slog.LevelError, "x"},
		{"[ERR] Failed to shutdown transport: e\n", slog.LevelError, "Failed to shutdown transport: e"},
		{"no prefix at all\n", slog.LevelInfo, "no prefix at all"},
		{"[TRACE] memberlist: unknown level\n", slog.LevelInfo, "[TRACE] memberlist: unknown level"},
		{"[", slog.LevelInfo, "["},
	}
	for _, tt := range tests {
		level, msg := parseLine([]byte(tt.line))
		if level != tt.level || msg != tt.msg {
			t.Errorf("parseLine(%q) = %v %q, want %v %q", tt.line, level, msg, tt.level, tt.msg)
		}
	}
}

func TestStdLoggerBridge(t *testing.T) {
	var buf bytes.Buffer
	l := newStdLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo})))
	l.Printf("[DEBUG] memberlist: hidden")
	l.Printf("[WARN] memberlist: Got ping for unexpected node %s", "x")
	out := buf.String()
	if strings.Contains(out, "hidden") {
		t.Errorf("debug line passed an Info handler: %s", out)
	}
	if !strings.Contains(out, `level=WARN msg="Got ping for unexpected node x" component=memberlist`) {
		t.Errorf("warn line not bridged: %q", out)
	}
}
