package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/tandem-llm/tandem/model/tokenizer"
)

func newTokenizeCmd() *cobra.Command {
	var (
		path      string
		noSpecial bool
		decode    bool
	)
	cmd := &cobra.Command{
		Use:   "tokenize --tokenizer FILE",
		Short: "Encode or decode text with a tokenizer.json",
		Long: `Read a JSON array of strings on stdin and print a JSON array of token id
arrays. With --decode, read a JSON array of id arrays and print a JSON array
of strings. --no-special leaves special tokens out (encoding: no BOS/EOS
added; decoding: special tokens skipped).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tok, err := tokenizer.Load(path)
			if err != nil {
				return err
			}
			return tokenize(tok, cmd.InOrStdin(), cmd.OutOrStdout(), decode, noSpecial)
		},
	}
	f := cmd.Flags()
	f.StringVar(&path, "tokenizer", "", "tokenizer.json file (required)")
	f.BoolVar(&noSpecial, "no-special", false, "leave special tokens out")
	f.BoolVar(&decode, "decode", false, "decode id arrays to strings")
	cmd.MarkFlagRequired("tokenizer")
	return cmd
}

func tokenize(tok *tokenizer.Tokenizer, in io.Reader, out io.Writer, decode, noSpecial bool) error {
	dec := json.NewDecoder(in)
	var res any
	if decode {
		var ids [][]int32
		if err := dec.Decode(&ids); err != nil {
			return fmt.Errorf("read stdin: want a JSON array of token id arrays: %w", err)
		}
		texts := make([]string, len(ids))
		for i, seq := range ids {
			for _, id := range seq {
				if id < 0 || int(id) >= tok.VocabSize() {
					return fmt.Errorf("sequence %d: token id %d outside the vocabulary of %d", i, id, tok.VocabSize())
				}
			}
			texts[i] = tok.Decode(seq, noSpecial)
		}
		res = texts
	} else {
		var texts []string
		if err := dec.Decode(&texts); err != nil {
			return fmt.Errorf("read stdin: want a JSON array of strings: %w", err)
		}
		ids := make([][]int32, len(texts))
		for i, t := range texts {
			ids[i] = tok.Encode(t, !noSpecial)
			if ids[i] == nil {
				ids[i] = []int32{}
			}
		}
		res = ids
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("read stdin: more input after the JSON array")
	}
	enc := json.NewEncoder(out)
	enc.SetEscapeHTML(false) // special tokens such as <|eot_id|> as they are
	return enc.Encode(res)
}
