package graphs

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"sync"
	"text/tabwriter"
)

// Stats counts dispatched steps by (unpadded tokens, padded tokens, runtime
// mode). The zero Stats is ready to use.
type Stats struct {
	mu     sync.Mutex
	counts map[statKey]uint64
}

type statKey struct {
	unpadded, padded int
	mode             Mode
}

// Row is one line of the statistics.
type Row struct {
	Unpadded int    `json:"unpadded"`
	Padded   int    `json:"padded"`
	Mode     Mode   `json:"mode"`
	Count    uint64 `json:"count"`
}

// Record counts one step of unpadded tokens run as mode at padded tokens.
func (s *Stats) Record(unpadded, padded int, mode Mode) {
	s.mu.Lock()
	if s.counts == nil {
		s.counts = make(map[statKey]uint64)
	}
	s.counts[statKey{unpadded, padded, mode}]++
	s.mu.Unlock()
}

// Snapshot is the counts so far, ordered by unpadded tokens, padded
// tokens, then mode.
func (s *Stats) Snapshot() []Row {
	s.mu.Lock()
	rows := make([]Row, 0, len(s.counts))
	for k, n := range s.counts {
		rows = append(rows, Row{Unpadded: k.unpadded, Padded: k.padded, Mode: k.mode, Count: n})
	}
	s.mu.Unlock()
	slices.SortFunc(rows, func(a, b Row) int {
		return cmp.Or(cmp.Compare(a.Unpadded, b.Unpadded), cmp.Compare(a.Padded, b.Padded), cmp.Compare(a.Mode, b.Mode))
	})
	return rows
}

// Format writes the counts so far as WriteTable does.
func (s *Stats) Format(w io.Writer) error { return WriteTable(w, s.Snapshot()) }

// WriteTable writes rows as an aligned table: a line with the total step
// count, then one line per row with its padding (padded - unpadded).
func WriteTable(w io.Writer, rows []Row) error {
	var total uint64
	for _, r := range rows {
		total += r.Count
	}
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintf(tw, "CUDA graph dispatch: %d steps\n", total)
	fmt.Fprintf(tw, " unpadded tokens\t padded tokens\t padding\t mode\t count\t\n")
	for _, r := range rows {
		fmt.Fprintf(tw, " %d\t %d\t %d\t %s\t %d\t\n", r.Unpadded, r.Padded, r.Padded-r.Unpadded, r.Mode, r.Count)
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write CUDA graph statistics: %w", err)
	}
	return nil
}
