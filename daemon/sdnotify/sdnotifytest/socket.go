package sdnotifytest

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// Socket is the stand-in for systemd's notification socket.
type Socket struct{ conn *net.UnixConn }

// Listen opens a socket in t's temporary directory, points NOTIFY_SOCKET
// at it until t ends, and closes it then.
func Listen(t *testing.T) *Socket {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	t.Setenv("NOTIFY_SOCKET", path)
	return &Socket{conn}
}

// Next returns the next message, or "" when none arrives within wait.
func (s *Socket) Next(t testing.TB, wait time.Duration) string {
	t.Helper()
	if err := s.conn.SetReadDeadline(time.Now().Add(wait)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, err := s.conn.Read(buf)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(buf[:n])
}

// Until returns the lines of the messages that arrive within wait, ending
// early after a line equal to want ("": read for all of wait).
func (s *Socket) Until(t testing.TB, wait time.Duration, want string) []string {
	t.Helper()
	var lines []string
	for deadline := time.Now().Add(wait); ; {
		left := time.Until(deadline)
		if left <= 0 {
			return lines
		}
		msg := s.Next(t, left)
		if msg == "" {
			return lines
		}
		got := strings.Split(strings.TrimSpace(msg), "\n")
		lines = append(lines, got...)
		if want != "" && slices.Contains(got, want) {
			return lines
		}
	}
}
