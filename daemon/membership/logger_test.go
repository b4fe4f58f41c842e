package membership

import (
	"bytes"
	"log"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/internal/lograte"
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

// TestPeerLinesRateLimited: warnings and errors naming a peer ("from=")
// pass at 1 a second in bursts of 10; the next that passes after drops is
// preceded by a count of them; other lines are never dropped.
func TestPeerLinesRateLimited(t *testing.T) {
	var buf bytes.Buffer
	var stopping atomic.Bool
	now := time.Unix(1000, 0)
	w := newSlogWriter(slog.New(slog.NewTextHandler(&buf, nil)), &stopping, func() time.Time { return now })
	l := log.New(w, "", 0)
	for i := range 100 {
		l.Printf("[ERR] memberlist: msg type (%d) not supported from=127.0.0.1:%d", i, 40000+i)
		l.Printf("[ERR] memberlist: Failed to send gossip to 10.0.0.%d: other", i)
	}
	out := buf.String()
	if n := strings.Count(out, "not supported"); n != 10 {
		t.Errorf("%d of 100 peer lines in one instant passed, want the burst of 10", n)
	}
	if n := strings.Count(out, "Failed to send gossip"); n != 100 {
		t.Errorf("%d of 100 lines not about a peer's packet passed, want all", n)
	}
	buf.Reset()
	now = now.Add(3 * time.Second)
	for range 5 {
		l.Printf("[WARN] memberlist: Got ping for unexpected node x from=127.0.0.1:1")
	}
	out = buf.String()
	if n := strings.Count(out, `msg="Got ping for unexpected node`); n != 3 {
		t.Errorf("%d peer lines passed 3 s later, want 3", n)
	}
	if !strings.Contains(out, "suppressed=90") || !strings.Contains(out, "component=memberlist") {
		t.Errorf("no count of the 90 dropped lines:\n%s", out)
	}
}

// TestGossipGarbageFlood floods a node's gossip port with garbage UDP
// datagrams: the log gets at most the burst plus one error line a second
// (it got one ERROR line per datagram), and the node still serves its
// cluster.
func TestGossipGarbageFlood(t *testing.T) {
	var logs lockedBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	a := startNode(t, "a", 0, nil, log)
	b := startNode(t, "b", 1, nil, nil, a.LocalAddr())
	conn, err := net.Dial("udp", a.LocalAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	const flood = 3000
	for i := range flood {
		conn.Write([]byte{0xf0 | byte(i%16), byte(i), 1, 2, 3})
	}
	eventually(t, 5*time.Second, "the flood reaches the log", func() bool {
		return strings.Count(logs.String(), "level=ERROR") >= lograte.PeerBurst
	})
	eventually(t, 5*time.Second, "the pair forms", func() bool {
		return sees(a, "b", Alive, withName(testMeta("b", 1), "b")) && sees(b, "a", Alive, withName(testMeta("a", 0), "a"))
	})
	bound := lograte.PeerBurst + int(time.Since(start).Seconds()*lograte.PeerRate) + 1
	if n := strings.Count(logs.String(), "level=ERROR"); n > bound {
		t.Errorf("%d ERROR lines for %d garbage datagrams in %v, want at most %d", n, flood, time.Since(start), bound)
	}
}
