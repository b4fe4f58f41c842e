package membership

import (
	"bytes"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
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
	var stopping atomic.Bool
	l := newStdLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo})), &stopping)
	closed := "[ERR] memberlist: Failed to send UDP ping: write udp 127.0.0.1:1->127.0.0.1:2: " + net.ErrClosed.Error()
	l.Printf("[DEBUG] memberlist: hidden")
	l.Printf("[WARN] memberlist: Got ping for unexpected node %s", "x")
	l.Print(closed)
	stopping.Store(true)
	l.Print(closed + " (stopping)")
	l.Printf("[ERR] memberlist: Failed to send gossip: other")
	out := buf.String()
	if strings.Contains(out, "hidden") {
		t.Errorf("debug line passed an Info handler: %s", out)
	}
	if !strings.Contains(out, `level=WARN msg="Got ping for unexpected node x" component=memberlist`) {
		t.Errorf("warn line not bridged: %q", out)
	}
	if !strings.Contains(out, `level=ERROR msg="Failed to send UDP ping`) {
		t.Errorf("a closed socket before Shutdown is still an error: %q", out)
	}
	if strings.Contains(out, "(stopping)") {
		t.Errorf("a closed socket after Shutdown began passed an Info handler: %q", out)
	}
	if !strings.Contains(out, `level=ERROR msg="Failed to send gossip: other"`) {
		t.Errorf("other errors while stopping must stay errors: %q", out)
	}
}
