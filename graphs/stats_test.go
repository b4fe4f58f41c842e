package graphs

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
)

func TestStatsSnapshot(t *testing.T) {
	var s Stats
	if got := s.Snapshot(); len(got) != 0 {
		t.Errorf("zero Stats: %v", got)
	}
	s.Record(3, 4, Piecewise)
	s.Record(1000, 1000, None)
	s.Record(3, 4, Full)
	s.Record(1, 1, Full)
	s.Record(3, 4, Piecewise)
	s.Record(3, 6, Piecewise)
	want := []Row{
		{1, 1, Full, 1},
		{3, 4, Piecewise, 2},
		{3, 4, Full, 1},
		{3, 6, Piecewise, 1},
		{1000, 1000, None, 1},
	}
	if got := s.Snapshot(); !slices.Equal(got, want) {
		t.Errorf("Snapshot() = %v\nwant %v", got, want)
	}
	b, err := json.Marshal(want[1])
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"unpadded":3,"padded":4,"mode":"PIECEWISE","count":2}` {
		t.Errorf("row JSON = %s", b)
	}
}

func TestStatsConcurrent(t *testing.T) {
	var s Stats
	const workers, each = 8, 500
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				s.Record(1+i%7, 8, Mode(w%3))
			}
		})
	}
	wg.Wait()
	var total uint64
	for _, r := range s.Snapshot() {
		total += r.Count
	}
	if total != workers*each {
		t.Errorf("total %d, want %d", total, workers*each)
	}
}

func TestStatsFormat(t *testing.T) {
	var s Stats
	s.Record(3, 4, Full)
	s.Record(3, 4, Full)
	s.Record(300, 304, Piecewise)
	s.Record(1000, 1000, None)
	var b strings.Builder
	if err := s.Format(&b); err != nil {
		t.Fatal(err)
	}
	want := `CUDA graph dispatch: 4 steps
  unpadded tokens|  padded tokens|  padding|       mode|  count|
                3|              4|        1|       FULL|      2|
              300|            304|        4|  PIECEWISE|      1|
             1000|           1000|        0|       NONE|      1|
`
	if b.String() != want {
		t.Errorf("Format:\n%s\nwant:\n%s", b.String(), want)
	}
	var empty strings.Builder
	if err := WriteTable(&empty, nil); err != nil || !strings.HasPrefix(empty.String(), "CUDA graph dispatch: 0 steps\n") {
		t.Errorf("empty table %q, %v", empty.String(), err)
	}
	if err := WriteTable(failWriter{}, []Row{{1, 1, Full, 1}}); err == nil || !strings.Contains(err.Error(), "write CUDA graph statistics") {
		t.Errorf("WriteTable to a failing writer: %v", err)
	}
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }
